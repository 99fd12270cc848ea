"""Projections that share their input as one matmul: attention's Q, K, V and SwiGLU's gate and up.

`FusedLinear` holds no parameters: the `nn.Linear`s are handed to it at each call, so parameter
names, checkpoints and the tensor-parallel plan are those of the unfused layers. x is read once, and
forward, x's gradient and the weights' gradients are one larger GEMM each.

The stacked weight [w_1; w_2; ...] lives only inside forward and backward (`StackedLinear`): autograd
keeps x and the weights themselves, as separate layers would, not a stacked copy per layer (under
FSDP that copy would outlive the resharded weights until backward). Zero-bubble pipeline schedules
swap in `SplitFusedLinear` (launcher/parallel/pipeline.py), whose weights' gradients are an autograd
node of their own; tensor parallelism wraps each in its shards' view (launcher/parallel/tensor.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _weight_grads(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, shapes: list, n_weights: int) -> list:
    """The gradients of the stacked weights, then biases, whose (shape, dtype) are `shapes`, from the
    product's gradient and its input."""
    g = grad.to(dtype).flatten(0, -2)
    rows = [shape[0] for shape, _ in shapes[:n_weights]]
    grad_w = (g.t() @ x.to(dtype).flatten(0, -2)).split(rows)
    grad_b = g.sum(0).split(rows) if n_weights < len(shapes) else ()
    return [gp.to(dt) for gp, (_, dt) in zip((*grad_w, *grad_b), shapes)]


class StackedLinear(torch.autograd.Function):
    """x @ [w_1; w_2; ...].T as one matmul. `weight_grads`: one node gives x's and the weights'
    gradients; without it the weights come in detached and `StackedLinearWeights` gives theirs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype, weight_grads: bool, *weights: torch.Tensor) -> Any:
        ctx.save_for_backward(x if weight_grads else None, *weights)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        ctx.shapes = [(w.shape, w.dtype) for w in weights]
        return x.to(dtype) @ torch.cat(weights).to(dtype).t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors  # unpacked once: checkpointing's saved-tensor hooks allow no more
        grad_x = (grad.to(ctx.dtype) @ torch.cat(weights).to(ctx.dtype)).to(ctx.x_dtype)
        if x is None:
            return grad_x, None, None, *(None for _ in weights)
        return grad_x, None, None, *_weight_grads(grad, x, ctx.dtype, ctx.shapes, len(weights))


class StackedLinearWeights(torch.autograd.Function):
    """The weights' (and biases') side of `StackedLinear` as its own autograd node beside it: forward
    returns the biases (zero without) expanded to the output's shape, to be added to the product;
    backward computes the weights' gradients from the saved x (given detached) and the output's
    gradient. Two nodes, so a zero-bubble schedule's input pass (torch's stage_backward_input) runs
    only the x side and its weight pass only this one; one node would compute both in both passes.
    Elsewhere one node is cheaper: the add is a pass over the output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype, n_weights: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.dtype, ctx.n_weights = dtype, n_weights
        ctx.shapes = [(p.shape, p.dtype) for p in params]
        weights, biases = params[:n_weights], params[n_weights:]
        width = sum(w.shape[0] for w in weights)
        bias = torch.cat(biases).to(dtype) if biases else x.new_zeros((), dtype=dtype)
        return bias.expand(*x.shape[:-1], width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        return None, None, None, *_weight_grads(grad, x, ctx.dtype, ctx.shapes, ctx.n_weights)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmul's dtype: autocast's where it is on (the Functions run with it off and cast themselves)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def autocast_input(module: nn.Module, args: tuple) -> tuple | None:
    """A forward pre-hook: the module's first input in the matmul's dtype (`compute_dtype`), cast once before the
    module, as its matmuls would cast it inside (None: already in that dtype, or no autocast)."""
    x = args[0]
    dtype = compute_dtype(x)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])


def converted(linears: tuple[nn.Linear, ...]) -> bool:
    """Whether a layer computes its own product (dtype=fp8: torchao's `Float8Linear` casts and scales
    each weight itself), so the projections run one by one instead of as one stacked matmul."""
    return any(type(lin) is not nn.Linear for lin in linears)


class FusedLinear(nn.Module):
    """`x` through several `nn.Linear`s that share it, as one matmul; returns their outputs side by
    side on the last dimension (the product itself: the pointwise nodes of launcher/ops/pointwise.py
    read it whole, and their gradients for it need no concatenation)."""

    def forward(self, x: torch.Tensor, *linears: nn.Linear) -> torch.Tensor:
        if converted(linears):  # one by one, concatenated: fp8 only
            return torch.cat([lin(x) for lin in linears], dim=-1)
        weights = [lin.weight for lin in linears]
        biases = [lin.bias for lin in linears if lin.bias is not None]
        return self.project(x, weights, biases)

    def project(self, x: torch.Tensor, weights: list, biases: list) -> torch.Tensor:
        """x @ [w_1; w_2; ...].T + [b_1; b_2; ...]."""
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            out = StackedLinear.apply(x, dtype, True, *weights)
            return out + torch.cat(biases).to(dtype) if biases else out


class SplitFusedLinear(FusedLinear):
    """`FusedLinear` whose weights' gradients are a node of their own, for a zero-bubble schedule's
    separate input and weight passes (same FLOPs, same gradients)."""

    def project(self, x: torch.Tensor, weights: list, biases: list) -> torch.Tensor:
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            product = StackedLinear.apply(x, dtype, False, *(w.detach() for w in weights))
            return product + StackedLinearWeights.apply(x.detach(), dtype, len(weights), *weights, *biases)
