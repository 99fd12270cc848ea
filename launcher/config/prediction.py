"""The seam between configuration and runtime, part three: the planner's prediction as a plain value.
`Prediction` (one layout's memory, step time, tokens/s, MFU), the `Memory` and `StepTime` it holds:
dataclasses only. The planner computes them (launcher/planner/predict.py, memory.py, cost.py); a
worker receives one in its `Run` (run.py) and puts it into summary.json beside what it measured,
without importing the planner. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from launcher.flops import GIB
from launcher.layout import Layout

PARTS = ("params", "grads", "optimizer", "buffers", "activations", "logits", "overhead", "held")  # Memory's, in order
_of_parts = attrgetter(*PARTS)


@dataclass(frozen=True)
class Memory:
    """Bytes on the busiest device."""

    params: float
    grads: float
    optimizer: float
    buffers: float  # compute-dtype working copies, gathered FSDP parameters
    activations: float
    logits: float
    overhead: float
    held: float = 0.0  # what the run keeps beside: a device rollback snapshot, replica groups' buckets
    total: float = field(init=False, repr=False, compare=False)  # the parts' sum, once: the search compares many

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", sum(_of_parts(self)))

    @property
    def checkpoint(self) -> float:
        """Bytes of this device's checkpoint shards: its fp32 weights and Adam moments, as DCP writes them."""
        return self.params + self.optimizer

    def as_gib(self) -> dict[str, float]:
        out = {k: round(getattr(self, k) / GIB, 3) for k in PARTS}
        out["total"] = round(self.total / GIB, 3)
        return out


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the busiest rank, by component."""

    compute: float  # forward + backward (+ recompute) of all microbatches
    tp_comm: float
    cp_comm: float  # K/V all-gathers and their gradients' reduce-scatters
    tp_host: float  # DTensor dispatch the device does not hide (cpu)
    pp_p2p: float
    pp_bubble: float
    dp_exposed: float  # data-parallel communication not hidden behind compute
    dp_total: float  # all data-parallel communication, hidden or not
    tp_level: str
    cp_level: str
    dp_level: str
    pp_level: str
    ep_comm: float = 0.0  # MoE all-to-alls (launcher/planner/moe.py)
    ep_level: str = ""
    host: float = 0.0  # every block's framework dispatch the device does not hide, MoE routing's copies (cpu)
    optimizer: float = 0.0  # the optimizer step over the rank's parameters (cpu)
    loss: float = 0.0  # the chunked loss's output-weight traffic (`loss_traffic`)
    tied_comm: float = 0.0  # tied embeddings, pp > 1: the embedding gradient's all-reduce (`tied_time`)
    fp8_cast: float = 0.0  # dtype=fp8: the amax and cast passes (launcher/planner/fp8.py)

    @property
    def total(self) -> float:
        comm = self.tp_comm + self.cp_comm + self.tp_host + self.pp_p2p + self.dp_exposed + self.ep_comm
        comm += self.tied_comm
        return self.compute + self.host + comm + self.pp_bubble + self.optimizer + self.loss + self.fp8_cast

    def as_dict(self) -> dict[str, float]:
        keys = ("compute", "host", "tp_comm", "cp_comm", "tp_host", "pp_p2p", "pp_bubble", "dp_exposed", "dp_total")
        keys += ("ep_comm", "optimizer", "loss", "tied_comm", "fp8_cast")
        out = {k: getattr(self, k) for k in keys}
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class Prediction:
    """What the planner predicts for one layout: the value `plan` ranks and `train` runs beside."""

    layout: Layout
    memory: Memory
    time: StepTime
    tokens_per_s: float
    mfu: float
    hfu: float  # hardware FLOPs utilisation: recomputation counted
    fits: bool
    bottleneck: str
    machine: str
    seq_len: int
    dtype: str = "bf16"  # the compute dtype of the blocks' matmuls: fp32 | bf16 | fp8
    mfu_fp8_peak: float | None = None  # fp8: model FLOPs utilisation against the fp8 peak (mfu: the bf16 peak)

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_microbatch(self) -> int:
        return self.layout.micro * self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch * self.seq_len

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "hardware": self.machine,
            "world": lay.world_size,
            **{key: getattr(lay, key) for key in ("tp", "pp", "cp", "dp", "dp_shard", "dp_replicate", "sharding")},
            "microbatch": lay.micro,
            "microbatches": lay.microbatches,
            "global_batch": lay.global_batch,
            "tokens_per_step": self.tokens_per_step,
            "schedule": lay.schedule if lay.pp > 1 else "none",
            "virtual_stages": lay.chunks,
            "recompute": lay.recompute,
            "recompute_layers": lay.recompute_layers,
            "sequence_parallel": lay.sequence_parallel,
            "zero": (3 if lay.reshard_after_forward else 2) if lay.dp_shard > 1 else 0,
            "ep": lay.ep,
            "memory_gib": round(self.memory.total / GIB, 3),
            "memory": self.memory.as_gib(),
            "checkpoint_bytes_per_rank": round(self.memory.checkpoint),  # the busiest device's
            "fits": self.fits,
            "step_time_s": self.time.total,
            "time_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bottleneck": self.bottleneck,
            "dtype": self.dtype,
            "mfu_fp8_peak": self.mfu_fp8_peak,
        }
