"""Fused projections (one matmul for Q/K/V, one for SwiGLU's gate and up) compute what the three
(two) separate layers did, and a checkpoint of an unfused model loads; the chunked loss equals
`F.cross_entropy` of the full logits, in value and gradients, without ever holding those logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from launcher.config.model import ModelConfig
from launcher.flops import device_flop_per_byte, head_dim, loss_chunk_rows
from launcher.model import attention, transformer
from launcher.model.init import initialized_model
from launcher.ops import loss as loss_module
from launcher.parallel.pipeline import split_weight_passes

GQA = dict(n_heads=8, n_kv_heads=2)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """RoPE as the textbook chain of ops (Llama's halves): x cos + rotate_half(x) sin."""
    cos, sin = rope[0, : x.shape[-2]], rope[1, : x.shape[-2]]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def unfused_attention(
    self: attention.Attention, x: torch.Tensor, rope: torch.Tensor | None, mask: None = None
) -> torch.Tensor:
    """The attention as it was before fusing: three projections, three matmuls (no document mask)."""
    b, s, _ = x.shape
    q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
    if rope is not None:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def unfused_feed_forward(self: transformer.FeedForward, x: torch.Tensor) -> torch.Tensor:
    if self.w3 is not None:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
    return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def logits_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", [dict(GQA), dict(mlp="gelu", bias=True, positions="learned")])
def test_fused_projections_match_the_separate_layers(arch: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dataclasses.replace(ModelConfig(), n_layers=2, **arch)
    model = initialized_model(cfg, 3, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    fused = logits_and_grads(model, tokens)
    monkeypatch.setattr(attention.Attention, "forward", unfused_attention)
    monkeypatch.setattr(transformer.FeedForward, "forward", unfused_feed_forward)
    separate = logits_and_grads(model, tokens)
    torch.testing.assert_close(fused[0], separate[0], rtol=1e-5, atol=1e-6)
    for name, grad in separate[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_checkpoint_of_the_unfused_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with the unfused forward, built here, writes its state; the fused one loads it and
    computes the same logits."""
    cfg = dataclasses.replace(ModelConfig(), n_layers=2, **GQA)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as old:
        old.setattr(attention.Attention, "forward", unfused_attention)
        old.setattr(transformer.FeedForward, "forward", unfused_feed_forward)
        writer = initialized_model(cfg, 11, torch.device("cpu"))
        expected = writer(tokens).detach()
        torch.save(writer.state_dict(), tmp_path / "unfused.pt")
    reader = initialized_model(cfg, 12, torch.device("cpu"))  # other weights, until it loads
    reader.load_state_dict(torch.load(tmp_path / "unfused.pt"), strict=True)
    torch.testing.assert_close(reader(tokens), expected, rtol=1e-5, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


# tokens per chunk: one chunk; 7 (the last short); 2048, what `1b` on an H200 runs (8 x 2048 tokens)
H200_1B_ROWS = loss_chunk_rows(8 * 2048, 128256, device_flop_per_byte("cuda", 989.0, 4800.0))


@pytest.mark.parametrize("rows", [10**6, 7, H200_1B_ROWS])
def test_chunked_loss_equals_cross_entropy(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_module, "loss_chunk_rows", lambda *_: rows)
    cfg = dataclasses.replace(ModelConfig(), n_layers=1)
    model = initialized_model(cfg, 5, torch.device("cpu"))
    batch, seq = (3, 17) if rows < 100 else (5, 1001)  # H200's: 5000 tokens, 2 whole chunks and a short one
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]
    reference = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    (loss * 2).backward()  # the incoming gradient is applied
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * expected[name], rtol=1e-4, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model(x, y), reference.detach(), rtol=1e-6, atol=1e-6)


def test_chunked_loss_never_holds_the_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_module, "loss_chunk_rows", lambda *_: 16)  # 16 of the 64 tokens at a time
    cfg = dataclasses.replace(ModelConfig(), n_layers=1, dim=32, n_heads=4, ffn_dim=32)
    model = initialized_model(cfg, 5, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(2))
    probe = LargestTensor()
    with probe:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert probe.numel < 64 * cfg.vocab_size  # (tokens, vocab) never materialized
    assert probe.numel >= 16 * cfg.vocab_size  # one chunk's logits was


class LogitMatmuls(TorchDispatchMode):
    """Rows of each matmul that makes logits (its output `vocab` wide): one per chunk of the loss."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


def test_the_loss_chunks_follow_the_hardware_profile() -> None:
    """Through the rank's build (the knobs the model is built with), as `train` runs it: a 16 MiB chunk
    of a 8192-token vocabulary is 512 rows, so 4096 tokens made 8 chunks, each re-reading the output
    weight; an H200's 206 FLOP per byte asks for 2198 rows: 2 chunks of 2048. On the cpu profile
    (45 FLOP per byte: 480 rows) the 16 MiB chunk is the larger: 8 of 512."""
    from launcher.config.schema import compose_config
    from launcher.train.setup import build
    from tests.conftest import run_for

    for hardware, rows in (("h200", [2048, 2048]), ("cpu", [512] * 8)):
        keys = ("+model=tiny", f"hardware={hardware}", "model.vocab_size=8192", "model.dim=32", "seq_len=256")
        cfg = compose_config(*keys, "batch.micro=16", "compile=false", "dtype=fp32")
        runner = build(run_for(cfg), 0, torch.device("cpu"))
        tokens = torch.randint(0, 8192, (16, 257), generator=torch.Generator().manual_seed(3))
        probe = LogitMatmuls(8192)
        with probe:
            runner.forward_backward(tokens[:, :-1], tokens[:, 1:])
        assert probe.rows == rows, hardware


def test_split_backward_computes_each_gradient_once() -> None:
    """A zero-bubble schedule's input pass then weight pass (torch's own) do the FLOPs of one backward,
    and give its gradients: the fused projections' x and weight gradients are separate autograd nodes
    there; outside zero-bubble schedules one node gives both (the same FLOPs and gradients)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.flop_counter import FlopCounterMode

    cfg = dataclasses.replace(ModelConfig(), n_layers=1, bias=True, **GQA)
    block = transformer.Block(cfg)
    rope = attention.rope_tables(head_dim(cfg), 16, cfg.rope_theta, torch.device("cpu"))
    x0, dy = torch.randn(2, 16, cfg.dim), torch.randn(2, 16, cfg.dim)
    params = list(block.parameters())

    def backward_flops(split: bool) -> tuple[int, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        if split:
            split_weight_passes(block)  # what shard_model does for zero-bubble schedules
        x = x0.clone().requires_grad_()
        out = block(x, rope)
        with FlopCounterMode(display=False) as counter:
            if split:
                _, groups = stage_backward_input([out], [dy], [x], iter(params))
                stage_backward_weight(iter(params), groups)
            else:
                out.backward(dy)
        return counter.get_total_flops(), [x.grad, *(p.grad for p in params)]

    whole, split = backward_flops(False), backward_flops(True)
    assert split[0] == whole[0] > 0
    for a, b in zip(whole[1], split[1], strict=True):
        torch.testing.assert_close(a, b)
