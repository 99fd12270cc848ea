"""The block's pointwise chains as single autograd nodes: SwiGLU's silu(gate) x up and RoPE on the
fused Q|K|V product.

Eager PyTorch runs each op of a chain as a pass over memory and autograd gives each its own
backward; splitting a fused product into its parts makes the backward concatenate their gradients
again (a copy of the whole product). These nodes take the fused product itself, write its gradient
into one buffer, and save nothing but what they read (peer shape, one process: SwiGLU's forward and
backward 0.14 -> 0.07 s a layer, Q|K|V with RoPE 0.04 -> 0.03 s; docs/parallelism.md "Speed on CPU").

These nodes are eager's only. Under `torch.compile` (`torch.compiler.is_compiling()`, decided at
trace time) the same chains are written as plain ops: dynamo refuses `out=` into the nodes'
non-contiguous views, and one such break inside a checkpointed block makes it fall back to eager
for the whole block. The compiler fuses the plain chain itself and picks what to save
(tests/unit/test_compile.py holds every block kind to one graph).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten


class SwiGLU(torch.autograd.Function):
    """silu(gate) x up from the fused product [gate | up] (last dimension); saves only that product
    (not silu(gate): backward recomputes it), and its gradient is one tensor (bitwise the chain's)."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.empty_like(gate_up)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        aten.silu.out(gate, out=grad_up)
        grad_up.mul_(grad)
        torch.mul(grad, up, out=grad_gate)
        aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return SwiGLU.apply(gate_up)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, sign: float = 1.0) -> None:
    """out = x rotated by the angles (sign -1: back, RoPE's gradient), where each head's two halves
    are the pairs (i, i + head_dim/2) as in Llama: x cos + (-x_2, x_1) sin, in three passes."""
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:], value=sign)


def split_heads(t: torch.Tensor, widths: list[int], head_dim: int) -> tuple[torch.Tensor, ...]:
    """(batch, seq, sum(widths)) -> one (batch, heads, seq, head_dim) view per width."""
    return tuple(part.view(*t.shape[:2], -1, head_dim).transpose(1, 2) for part in t.split(widths, dim=-1))


class RotaryQKV(torch.autograd.Function):
    """The fused Q|K|V product (batch, seq, widths) -> q and k rotated, and v, each (batch, heads, seq,
    head_dim) as SDPA reads them; backward writes the product's gradient in place of the split's
    concatenation. Saves nothing but the angles."""

    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, rope: torch.Tensor, widths: list[int], head_dim: int) -> Any:
        cos, sin = rope[0].to(qkv.dtype), rope[1].to(qkv.dtype)
        ctx.save_for_backward(cos, sin)
        ctx.widths, ctx.head_dim = widths, head_dim
        q, k, v = split_heads(qkv, widths, head_dim)
        # laid out (batch, seq, heads, head_dim) as the product is: SDPA's output then is too, and the
        # output projection reads it through a view, not a copy that would be saved beside it; each its
        # own storage: context parallelism saves the all-gathered K, not this one
        q_out, k_out = (split_heads(qkv.new_empty(*qkv.shape[:2], w), [w], head_dim)[0] for w in widths[:2])
        rotate(q, cos, sin, q_out)
        rotate(k, cos, sin, k_out)
        # contiguous: SDPA saves v, and a view of the product would keep the unrotated q and k alive
        return q_out, k_out, v.contiguous()

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor) -> Any:
        cos, sin = ctx.saved_tensors
        out = grad_q.new_empty(grad_q.shape[0], grad_q.shape[2], sum(ctx.widths))
        q, k, v = split_heads(out, ctx.widths, ctx.head_dim)
        rotate(grad_q, cos, sin, q, -1.0)
        rotate(grad_k, cos, sin, k, -1.0)
        v.copy_(grad_v)
        return out, None, None, None


def rotary_qkv(qkv: torch.Tensor, rope: torch.Tensor, widths: list[int], head_dim: int) -> Any:
    """q, k (rotated) and v from the fused product (batch, seq, widths); `rope`: cos and sin stacked,
    (2, positions, head_dim) read from its first row, or (2, batch, seq, head_dim) per token
    (document positions: launcher/model/documents.py)."""
    angles = rope[:, :, None] if rope.dim() == 4 else rope[:, : qkv.shape[1]]
    if torch.compiler.is_compiling():
        cos, sin = angles[0].to(qkv.dtype), angles[1].to(qkv.dtype)
        q, k, v = split_heads(qkv, widths, head_dim)
        return rotated(q, cos, sin), rotated(k, cos, sin), v
    return RotaryQKV.apply(qkv, angles, widths, head_dim)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate` as plain ops, for the compiler to fuse: x cos + (-x_2, x_1) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
