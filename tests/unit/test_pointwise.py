"""The block's pointwise nodes (launcher/ops/pointwise.py) against the op-by-op chains they replace:
same values and gradients, the product's gradient written without a concatenation, and only the
product saved."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.model.attention import rope_tables
from launcher.ops.pointwise import rotary_qkv, swiglu
from tests.unit.test_fused import apply_rope


class Ops(TorchDispatchMode):
    """The aten ops that run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def saved_storages(fn: Any, *args: torch.Tensor) -> set[int]:
    """Storages autograd saves while `fn` runs."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return seen


def test_swiglu_is_the_chain_bitwise_and_saves_only_its_input() -> None:
    gate_up = torch.randn(2, 5, 2 * 12, requires_grad=True)
    grad = torch.randn(2, 5, 12)
    gate, up = gate_up.split(12, dim=-1)
    chain = F.silu(gate) * up
    (chain_grad,) = torch.autograd.grad(chain, gate_up, grad)
    out = swiglu(gate_up)
    with Ops() as backward:
        (node_grad,) = torch.autograd.grad(out, gate_up, grad)
    assert torch.equal(out, chain) and torch.equal(node_grad, chain_grad)
    assert "cat.default" not in backward.ops
    assert saved_storages(swiglu, gate_up) == {gate_up.untyped_storage().data_ptr()}


@pytest.mark.parametrize("documents", [False, True])
def test_rotary_qkv_matches_the_chain_and_writes_one_gradient(documents: bool) -> None:
    b, s, hd, heads, kv = 2, 6, 8, 4, 2  # GQA: K and V narrower than Q
    widths = [heads * hd, kv * hd, kv * hd]
    table = rope_tables(hd, 16, 10000.0, torch.device("cpu"))
    # per-token rows (document positions restart at each document) or the table's first rows
    rope = table[:, torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])] if documents else table
    qkv = torch.randn(b, s, sum(widths), requires_grad=True)
    grads = [torch.randn(b, w // hd, s, hd) for w in widths]

    def chain(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in qkv.split(widths, dim=-1))
        if documents:  # the textbook chain on per-token rows: (2, batch, 1, seq, head_dim)
            cos, sin = rope[0, :, None], rope[1, :, None]
            half = hd // 2
            rot = [x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin for x in (q, k)]
            return (*rot, v)
        return apply_rope(q, rope), apply_rope(k, rope), v

    expected = chain(qkv)
    (expected_grad,) = torch.autograd.grad(expected, qkv, grads)
    out = rotary_qkv(qkv, rope, widths, hd)
    with Ops() as backward:
        (grad,) = torch.autograd.grad(out, qkv, grads)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)
    assert "cat.default" not in backward.ops
    # nothing of the product saved (the angles are views of the table): SDPA saves what it needs
    assert qkv.untyped_storage().data_ptr() not in saved_storages(rotary_qkv, qkv, rope, widths, hd)
