"""The routed experts' SwiGLU over rows grouped by expert: a loop over experts, or one grouped GEMM.

`loop` (every device and dtype): one matmul per expert and weight. `grouped_mm` (CUDA sm90/sm100, bf16):
`torch._grouped_mm` runs all experts' matmuls of one weight in one kernel (`compat.grouped_mm`),
given each group's end row as int32 offsets. Its bf16 kernel wants 16-byte aligned rows and group
starts, so the widths must be multiples of 8 and every group is padded with zero rows to a multiple
of 8 (zero rows give zero outputs and add nothing to the weights' gradients). `parallelize` picks
the path once per run (`select_impl`); the summary records it as `expert_impl`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launcher.compat import grouped_mm, grouped_mm_kernel

ALIGN = 8  # rows and widths: 16 bytes of bf16


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (DTensor under tensor or expert parallelism)."""
    return t.to_local() if hasattr(t, "to_local") else t


def select_impl(experts: Experts, device: torch.device, bf16: bool) -> str:
    """`grouped_mm` where its fast kernel runs (CUDA sm90/sm100, bf16 compute, widths aligned), else `loop`."""
    widths = experts.w1.shape[1:]
    aligned = all(w % ALIGN == 0 for w in widths)
    return "grouped_mm" if bf16 and aligned and grouped_mm_kernel(device) else "loop"


def group_offsets(counts: list[int], device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Each group padded to a multiple of ALIGN rows: the groups' ends as int32 offsets, the padded
    rows in all, and where each of the sum(counts) rows goes among them (None: all groups aligned).
    One copy to the device, from pinned memory: no wait for the device's queue."""
    padded = [-(-c // ALIGN) * ALIGN for c in counts]
    host = torch.tensor([counts, padded])
    sizes = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    ends = sizes.cumsum(1)
    if padded == counts:
        return ends[1].to(torch.int32), sum(padded), None
    shift = (ends[1] - sizes[1]) - (ends[0] - sizes[0])  # each group's padded start minus its start
    rows = sum(counts)
    dest = torch.arange(rows, device=device) + shift.repeat_interleave(sizes[0], output_size=rows)
    return ends[1].to(torch.int32), sum(padded), dest


def loop_swiglu(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    # unbind, not w[e]: indexing's backward writes a whole (E, ...) zero gradient per expert
    chunks = zip(x.split(counts), w1.unbind(0), w3.unbind(0), w2.unbind(0))
    outs = [(F.silu(c @ a) * (c @ b)) @ d for c, a, b, d in chunks]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


def grouped_swiglu(
    x: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The same SwiGLU, three grouped GEMMs computed in `dtype` (bf16: what autocast's matmuls do)."""
    x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
    offsets, rows, dest = group_offsets(counts, x.device)
    if dest is not None:
        x = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)
    h = F.silu(grouped_mm(x, w1, offsets)) * grouped_mm(x, w3, offsets)
    out = grouped_mm(h, w2, offsets)
    return out if dest is None else out[dest]


class GradDivide(torch.autograd.Function):
    """The experts' weights outside FSDP (edp = 1): FSDP's part done here. Forward passes the weight (cast
    to the input's dtype: FSDP's parameter dtype, or theirs); backward divides its gradient by the
    data-parallel ranks, as FSDP divides each micro-batch's reduced gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.factor, None


class Experts(nn.Module):
    """Routed SwiGLU experts stacked along dim 0: w1, w3 (E, dim, hidden), w2 (E, hidden, dim)."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.impl = "loop"  # or "grouped_mm": `select_impl`, set once by `parallelize`
        self.grad_divide = 1.0  # outside FSDP: FSDP's division of the gradients (launcher/parallel/expert.py)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows grouped by local expert, counts[e] rows for expert e."""
        # no rows at all (an ep rank sent nothing this micro-batch): the loop, not a grouped GEMM of none
        compute = grouped_swiglu if self.impl == "grouped_mm" and x.shape[0] else loop_swiglu
        weights = [local(w) for w in (self.w1, self.w3, self.w2)]
        if self.grad_divide != 1.0:  # outside FSDP (edp = 1: launcher/parallel/expert.py): do its part
            weights = [GradDivide.apply(w.to(x.dtype), self.grad_divide) for w in weights]
        return compute(x, counts, *weights)
