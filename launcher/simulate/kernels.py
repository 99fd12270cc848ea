"""What CUDA's kernels save for backward, where they differ from the CPU's: the simulation runs on the CPU device
(step.py) but answers for a GPU profile, so a CUDA kernel that keeps less than the CPU's composite runs here as a
node that keeps what the kernel keeps (the values are not computed: the tensors are fake).

- RMSNorm: on CUDA `F.rms_norm` is one fused kernel (`aten._fused_rms_norm`) that keeps its input, weight and
  the fp32 rstd. The CPU composes it from ops that keep an fp32 copy of the input (under bf16 parameters), rstd
  and the fp32 normalized input besides: 4 to 10 bytes an element more, per norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


class FusedRMSNorm(torch.autograd.Function):
    """`F.rms_norm` keeping what CUDA's fused kernel keeps: input, weight and rstd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: list[int], weight: torch.Tensor | None, eps: float | None) -> Any:
        y, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        mask = [True, weight is not None]
        grad_x, grad_w = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.shape, rstd, weight, mask)
        return grad_x, None, grad_w, None


def fused_rms_norm(
    x: torch.Tensor, shape: list[int], weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    return FusedRMSNorm.apply(x, list(shape), weight, eps)


@contextlib.contextmanager
def cuda_kernels(kind: str) -> Iterator[None]:
    """For a `cuda` profile, the CUDA kernels' saved tensors (module docstring) while the position runs."""
    if kind != "cuda":
        yield
        return
    kept = F.rms_norm
    F.rms_norm = fused_rms_norm
    try:
        yield
    finally:
        F.rms_norm = kept
