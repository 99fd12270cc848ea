"""The routed experts' SwiGLU over rows grouped by expert: a loop over experts, or one grouped GEMM.

`loop` (every device and dtype): one matmul per expert and weight. `grouped_mm` (CUDA sm90/sm100, bf16):
`torch._grouped_mm` runs all experts' matmuls of one weight in one kernel (`compat.grouped_mm`),
given each group's end row as int32 offsets. Its bf16 kernel wants 16-byte aligned rows and group
starts, so the widths must be multiples of 8 and every group is padded with zero rows to a multiple
of 8 (zero rows give zero outputs and add nothing to the weights' gradients). A run picks the path
once (`select_impl`, launcher/model/knobs.py); the summary records it as `expert_impl`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launcher.compat.torch_compat import grouped_mm, grouped_mm_kernel
from launcher.ops.fused import compute_dtype

ALIGN = 8  # rows and widths: 16 bytes of bf16


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (DTensor under tensor or expert parallelism)."""
    return t.to_local() if hasattr(t, "to_local") else t


def select_impl(dim: int, hidden: int, device: torch.device, bf16: bool) -> str:
    """`grouped_mm` where its fast kernel runs (CUDA sm90/sm100, bf16 compute, the experts' widths `dim`
    and `hidden` aligned), else `loop`."""
    aligned = dim % ALIGN == 0 and hidden % ALIGN == 0
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


def expert_products(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per expert: its rows' gate (x w1) and up (x w3), and its output silu(gate) x up through w2."""
    # unbind, not w[e]: indexing's backward writes a whole (E, ...) zero gradient per expert
    chunks = x.split(counts)
    gates = [c @ a for c, a in zip(chunks, w1.unbind(0))]
    ups = [c @ b for c, b in zip(chunks, w3.unbind(0))]
    return gates, ups, [(F.silu(g) * u) @ d for g, u, d in zip(gates, ups, w2.unbind(0))]


def loop_swiglu(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The experts as autograd's chain of ops (every rank holds an expert: the outputs are never none)."""
    return torch.cat(expert_products(x, counts, w1, w3, w2)[2])


class ExpertLoop(torch.autograd.Function):
    """`loop_swiglu` as one autograd node: the same ops in the same order (bitwise the chain's values and
    gradients), but backward writes x's gradient and each stacked weight's into one buffer (the chain's
    `split` and `unbind` backwards concatenate and stack them) and recomputes silu(gate) and its product
    with up: a routed row saves gate and up (2f), not the chain's 4f. The forward's ops are the chain's
    (matmuls returning new tensors, no `out=`), so selective recompute saves their products as it does
    the chain's. A zero-bubble schedule keeps the chain (`Experts.split_weights`): one node would also
    compute the weights' gradients in the schedule's input pass."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: list[int], dtype: torch.dtype, *weights: torch.Tensor) -> Any:
        ctx.counts, ctx.dtype, ctx.x_dtype = counts, dtype, rows.dtype
        x = rows.to(dtype)  # saved in the matmuls' dtype, as autocast's casts are
        gates, ups, outs = expert_products(x, counts, *(w.to(dtype) for w in weights))
        ctx.save_for_backward(x, *weights, *gates, *ups)
        return torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *saved = ctx.saved_tensors  # unpacked once: checkpointing's saved-tensor hooks allow no more
        n, dtype = len(ctx.counts), ctx.dtype
        weights, gates, ups = saved[:3], saved[3 : 3 + n], saved[3 + n :]
        w1, w3, w2 = (w.to(dtype) for w in weights)
        grads = [torch.empty(w.shape, dtype=dtype, device=w.device) for w in weights]
        grad_x = torch.empty(x.shape, dtype=ctx.x_dtype, device=x.device)
        rows = zip(x.split(ctx.counts), grad.to(dtype).split(ctx.counts), grad_x.split(ctx.counts))
        for e, ((c, dy, dx), g, u) in enumerate(zip(rows, gates, ups)):
            silu = F.silu(g)
            torch.mm((silu * u).t(), dy, out=grads[2][e])
            dh = dy @ w2[e].t()
            d_up, d_gate = dh * silu, torch.ops.aten.silu_backward(dh * u, g)
            torch.mm(c.t(), d_gate, out=grads[0][e])
            torch.mm(c.t(), d_up, out=grads[1][e])
            # the two products added in x's dtype, as the chain's two casts back from autocast's are
            dx.copy_(d_gate @ w1[e].t()).add_(d_up @ w3[e].t())
        return grad_x, None, None, *(g.to(w.dtype) for g, w in zip(grads, weights))


def node_swiglu(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`ExpertLoop` in autocast's dtype where it is on (the node runs with it off and casts itself)."""
    dtype = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return ExpertLoop.apply(x, counts, dtype, w1, w3, w2)


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
    """The experts' weights outside FSDP (edp = 1, a policy that casts nothing): FSDP's part done here. Forward
    passes the weight; backward divides its gradient by the data-parallel ranks, as FSDP divides each
    micro-batch's reduced gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.factor, None


class Experts(nn.Module):
    """Routed SwiGLU experts stacked along dim 0: w1, w3 (E, dim, hidden), w2 (E, hidden, dim)."""

    def __init__(self, n: int, dim: int, hidden: int, impl: str = "loop") -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.impl = impl  # loop | grouped_mm (`select_impl`)
        self.grad_divide = 1.0  # outside FSDP: FSDP's division of the gradients (launcher/parallel/expert.py)
        self.split_weights = False  # a zero-bubble schedule's: the loop as autograd's chain, not one node

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows grouped by local expert, counts[e] rows for expert e."""
        # no rows at all (an ep rank sent nothing this micro-batch): the loop, not a grouped GEMM of none
        if self.impl == "grouped_mm" and x.shape[0]:
            compute = grouped_swiglu
        else:
            compute = loop_swiglu if self.split_weights else node_swiglu
        weights = [local(w) for w in (self.w1, self.w3, self.w2)]
        if self.grad_divide != 1.0:  # outside FSDP (edp = 1 and no cast: launcher/parallel/expert.py): do its part
            weights = [GradDivide.apply(w, self.grad_divide) for w in weights]
        return compute(x, counts, *weights)
