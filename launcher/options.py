"""The seam between configuration and runtime: what a worker receives instead of the raw config.

`BuildOptions` are the few decisions about how to build and run the model that the layout does not
hold, each resolved once from the config (`planner.resolve`). `Run` is a whole training run as a
worker sees it: the Layout, the planner's Prediction, the options and the config sections the loop
reads (`spawn.run_of` builds it). Both are plain frozen values: a Run crosses to the workers pickled
(the elastic agent's arguments). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    GuardConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ProfileConfig,
    WatchdogConfig,
)
from launcher.layout import Layout

if TYPE_CHECKING:
    from launcher.planner import Prediction


@dataclass(frozen=True)
class BuildOptions:
    """How the runtime builds and measures the model (everything about the cut is in the Layout)."""

    seed: int
    precision: str  # fp32 | fsdp_bf16 | autocast_bf16 (launcher/precision.py)
    compile: bool  # torch.compile per block (compile=auto resolved)
    async_tp: bool  # torch's async TP overlaps this layout's TP collectives (asked for, and it applies)
    seq_len: int
    init_from: str | None  # a Hugging Face folder the weights start from (init.from); None: seeded random
    device: str  # the hardware kind: cuda | cpu
    threads: int  # torch intra-op threads per worker
    peak_flops: float  # per device: the MFU's denominator
    flop_per_byte: float  # the device's peak over its memory bandwidth: the chunked loss's chunk size


@dataclass(frozen=True)
class Run:
    """One training run as every rank receives it."""

    layout: Layout
    prediction: Prediction | None  # the planner's, put into summary.json beside what was measured
    options: BuildOptions
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    checkpoint: CheckpointConfig
    guard: GuardConfig
    metrics: MetricsConfig
    eval: EvalConfig
    profile: ProfileConfig
    watchdog: WatchdogConfig
    steps: int
    smoke: bool
    resume: str  # auto | never | PATH
    cpu_allocator: str
    nccl_timeout_s: int
    max_restarts: int
    record: dict[str, Any]  # the whole config, as the wandb run records it

    @property
    def predicted_step_s(self) -> float:
        """The planner's step time (0.0 without a prediction): the watchdog's timeout follows it."""
        return self.prediction.step_time_s if self.prediction else 0.0
