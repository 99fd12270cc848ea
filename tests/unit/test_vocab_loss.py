"""The chunked loss over vocabulary shards (launcher/parallel/vocab.py) equals the chunked loss over the
whole vocabulary: the mean loss, the per-token losses and the gradients of the hidden states and the
output weight, over several uneven chunks, with the hidden states replicated or sequence-sharded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from launcher.ops.loss import linear_cross_entropy, token_losses
from tests.dist import run

BATCH, SEQ, DIM, VOCAB, ROWS = 2, 8, 16, 64, 5  # 16 tokens in chunks of 5: the last one short


def sharded_against_whole(rank: int, world: int, sequence_parallel: bool) -> dict[str, Any]:
    import launcher.parallel.vocab as vocab

    vocab.loss_chunk_rows = lambda *_: ROWS  # several chunks at this tiny size
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randn(VOCAB, DIM, generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with token_losses() as ref_tokens:
        ref = linear_cross_entropy(ref_h, ref_w, y, ROWS)
    ref.backward()
    part = SEQ // world
    mine = (h[:, rank * part : (rank + 1) * part] if sequence_parallel else h).clone().requires_grad_()
    weight = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    loss_fn = vocab.VocabParallelLoss(mesh, Shard(1) if sequence_parallel else Replicate())
    with token_losses() as tokens:
        loss = loss_fn(mine, weight, y, 0.0)
    loss.backward()
    want_h = ref_h.grad[:, rank * part : (rank + 1) * part] if sequence_parallel else ref_h.grad
    assert mine.grad is not None and weight.grad is not None
    return {
        "loss": (loss.item(), ref.item()),
        "tokens": (tokens[0], ref_tokens[0]),
        "grad_h": (mine.grad, want_h),
        "grad_w": (weight.grad.full_tensor(), ref_w.grad),
        "local_logit_cols": weight.to_local().shape[0],
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_chunked_loss_equals_the_whole_vocabulary(sequence_parallel: bool) -> None:
    for result in run(sharded_against_whole, 2, sequence_parallel):
        assert result["local_logit_cols"] == VOCAB // 2
        got, want = result["loss"]
        assert got == pytest.approx(want, rel=1e-6)
        for key in ("tokens", "grad_h", "grad_w"):
            torch.testing.assert_close(*result[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
