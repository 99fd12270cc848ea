"""The chunked loss over vocabulary shards (tensor parallelism): ops/loss.py's output projection and
loss together, chunk by chunk, on this rank's slice of the output weight.

Per chunk each rank computes its (rows, vocab / tp) logits, then two all-reduces of per-token scalars
make the loss exact: the maximum of the ranks' log-sum-exps, then the sum of their exp-shifted
log-sum-exps with the target's logit (held by one rank, zero elsewhere). The softmax minus the one-hot
is formed locally; d loss / d h is each rank's partial sum, which the input's DTensor reduces in backward
(all-reduce, or reduce-scatter under sequence parallelism: Megatron's "f"), as the column-parallel output
projection's would. The logits are never whole on a rank, not even a chunk's; the ranks exchange 2 x 4
bytes per token per chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from launcher.flops import loss_chunk_rows
from launcher.ops.loss import OutputLoss, Vocab, linear_cross_entropy


class VocabShard(Vocab):
    """Rows [start, start + size) of the vocabulary on this rank of `group`."""

    def __init__(self, group: dist.ProcessGroup, start: int, size: int) -> None:
        self.group, self.start, self.size = group, start, size

    def lse_and_target(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse = logits.logsumexp(-1)
        top = lse.clone()
        dist.all_reduce(top, dist.ReduceOp.MAX, group=self.group)
        cols = targets - self.start
        here = (cols >= 0) & (cols < self.size)
        cols = torch.where(here, cols, -1)
        target = logits.gather(1, cols.clamp(min=0)[:, None]).squeeze(1) * here
        both = torch.stack([(lse - top).exp(), target])
        dist.all_reduce(both, group=self.group)
        return top + both[0].log(), both[1], cols


class VocabParallelLoss(OutputLoss):
    """OutputLoss on this rank's vocabulary rows of a Shard(0) output weight; `stream`: the placement
    of the final hidden states over the tensor-parallel mesh (Shard(1) under sequence parallelism)."""

    def __init__(self, mesh: DeviceMesh, stream: Placement) -> None:
        super().__init__()
        self.mesh, self.stream = mesh, stream

    def forward(
        self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, flop_per_byte: float
    ) -> torch.Tensor:
        assert isinstance(weight, DTensor), "the tensor-parallel plan shards the output weight"
        whole = DTensor.from_local(h, self.mesh, [self.stream], run_check=False).redistribute(self.mesh, [Replicate()])
        x = whole.to_local(grad_placements=[Partial()])  # each rank's d loss / d h is a partial sum
        w = weight.to_local()
        shard = VocabShard(self.mesh.get_group(), self.mesh.get_local_rank() * w.shape[0], w.shape[0])
        rows = loss_chunk_rows(targets.numel(), w.shape[0], flop_per_byte)
        return linear_cross_entropy(x, w, targets, rows, shard)
