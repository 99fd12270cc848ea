"""A layout's prediction: memory, step time by component, tokens/s, MFU and HFU, whether it fits,
and what bounds it (`bottleneck`), for one `Problem` (the model, sequence length, world and machine).
The value itself, `Prediction`, is plain data a worker receives: launcher/config/prediction.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

from launcher.config.ft import BUCKET_BYTES, BUCKETS_IN_FLIGHT
from launcher.config.model import ModelConfig
from launcher.config.prediction import Memory, Prediction, StepTime
from launcher.flops import mfu
from launcher.hardware.machine import Machine
from launcher.layout import Layout
from launcher.planner.cost import lower_bound, step_time
from launcher.planner.efficiency import compute_efficiency
from launcher.planner.fp8 import Fp8, weight_bytes
from launcher.planner.memo import flops_per_token, hardware_flops_per_token
from launcher.planner.memory import memory, rank_layers, recomputed_layers


@dataclass(frozen=True)
class Problem:
    """What is planned: a model and sequence length on `world` devices of one machine type."""

    model: ModelConfig
    seq: int
    world: int
    machine: Machine
    elem: int  # bytes per activation element (compute dtype)
    async_tp: bool = False  # TP collectives overlapped with their matmuls (config async_tp)
    fused_attention: bool = True  # SDPA's kernels, as the runtime calls them (False: Megatron before FlashAttention)
    compiled: bool = True  # blocks compiled (config compile; XLA on a TPU): eager pays unfused pointwise passes
    span: float = 0.0  # keys per query under document masking (flops.document_span); 0: the sequence
    documents: bool = False  # data.document_mask: the masks forward builds and backward reads (memory.py)
    fp8: Fp8 | None = None  # dtype=fp8: the blocks' linear layers in fp8 (launcher/planner/fp8.py)
    device_snapshot: bool = False  # guard.snapshot=device under rollback: each rank's weights and Adam moments again
    ft: bool = False  # ft.replicas: the cross-group all-reduce's buckets (ft_config.BUCKET_BYTES)

    @property
    def dtype(self) -> str:
        return "fp8" if self.fp8 else ("fp32" if self.elem == 4 else "bf16")


# the components `bottleneck` names, in its order of preference on a tie
PARTS_OF = attrgetter(
    "tp_comm", "cp_comm", "tp_host", "pp_bubble", "dp_exposed", "pp_p2p", "ep_comm", "loss", "tied_comm", "fp8_cast"
)
BOUND_NAMES = (
    "TP communication over {t.tp_level}",
    "CP communication over {t.cp_level}",
    "tensor-parallel dispatch on the host",
    "pipeline bubble",
    "DP communication over {t.dp_level}",
    "pipeline sends over {t.pp_level}",
    "MoE all-to-all over {t.ep_level}",
    "the chunked loss's weight traffic",
    "the tied embedding's gradient all-reduce over {t.pp_level}",
    "fp8 amax and cast passes",
)


def bottleneck(t: StepTime, efficiency: float) -> str:
    """The component that takes the largest share of the step, if 10% or more; else compute."""
    total = t.total
    shares = [v / total for v in PARTS_OF(t)]
    first = max(range(len(shares)), key=shares.__getitem__)  # the first largest; only its name is formatted
    if shares[first] >= 0.1:
        return f"{BOUND_NAMES[first].format(t=t)} ({shares[first]:.0%} of step)"
    return f"compute ({t.compute / t.total:.0%} of step at {efficiency:.0%} of peak)"


def problem_memory(problem: Problem, layout: Layout) -> Memory:
    """Memory of the busiest device of `layout` for `problem`."""
    m, mach = problem.model, problem.machine
    args = (m, problem.seq, layout, problem.elem, mach.kind, mach.flop_per_byte, problem.fused_attention)
    mem = memory(*args, documents=problem.documents)
    held = mem.checkpoint if problem.device_snapshot else 0.0  # what a checkpoint of this rank holds, on the device
    held += BUCKET_BYTES * BUCKETS_IN_FLIGHT if problem.ft else 0.0
    if held:  # (memory's own is 0)
        mem = replace(mem, held=held)
    return with_fp8(problem, layout, mem, max(rank_layers(m.n_layers, layout.pp, layout.chunks, layout.v_shape)))


def with_fp8(problem: Problem, layout: Layout, mem: Memory, layers: int) -> Memory:
    """`mem` of a rank holding `layers` blocks, plus their fp8 weight copies under dtype=fp8 (planner/fp8.py)."""
    if problem.fp8 is None:
        return mem
    return replace(mem, buffers=mem.buffers + weight_bytes(problem.fp8, problem.model, layout, layers))


def _time_args(problem: Problem, layout: Layout) -> tuple[Any, ...]:
    """`cost.step_time`'s arguments for `layout` in `problem`."""
    return (
        problem.model, problem.seq, layout, problem.machine, problem.elem, problem.async_tp, problem.fused_attention,
        problem.compiled, problem.fp8, problem.span,
    )  # fmt: skip


def speed_bound(problem: Problem, layout: Layout) -> float:
    """No less than `predict(problem, layout).tokens_per_s`, for less work: the step's `cost.lower_bound` in place
    of its time (the same division, so rounding keeps the order)."""
    return layout.global_batch * problem.seq / lower_bound(*_time_args(problem, layout))


def predict(problem: Problem, layout: Layout, mem: Memory | None = None) -> Prediction:
    """Memory, step time and utilisation of `layout` (`mem`: its memory, when already known)."""
    m, mach = problem.model, problem.machine
    mem = mem or problem_memory(problem, layout)
    t = step_time(*_time_args(problem, layout))
    span = problem.span or problem.seq
    tokens_per_s = layout.global_batch * problem.seq / t.total
    peak = mach.peak_flops
    per_device = tokens_per_s / layout.world_size
    fp8_peak = problem.fp8.peak_flops if problem.fp8 else None
    return Prediction(
        layout=layout,
        memory=mem,
        time=t,
        tokens_per_s=tokens_per_s,
        mfu=mfu(per_device, flops_per_token(m, span), peak),
        hfu=mfu(per_device, hardware_flops_per_token(m, span, recomputed_layers(m.n_layers, layout)), peak),
        fits=mem.total <= mach.memory_bytes,
        bottleneck=bottleneck(t, compute_efficiency(mach, m, layout, layout.micro * problem.seq // layout.cp)),
        machine=mach.name,
        seq_len=problem.seq,
        dtype=problem.dtype,
        mfu_fp8_peak=mfu(per_device, flops_per_token(m, problem.seq), fp8_peak) if fp8_peak else None,
    )
