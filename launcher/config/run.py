"""The seam between configuration and runtime, part two: `Run`, one training run as every rank
receives it instead of the raw config: the Layout, the planner's Prediction, the BuildOptions and the
config sections the loop reads (`cli.run_of` builds it). A plain frozen value: it crosses to the
workers pickled (the elastic agent's arguments). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.config.ft import FtConfig
from launcher.config.model import ModelConfig
from launcher.config.options import BuildOptions
from launcher.config.prediction import Prediction
from launcher.config.schema import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    GuardConfig,
    MetricsConfig,
    OptimConfig,
    ProfileConfig,
    WatchdogConfig,
)
from launcher.layout import Layout


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
    nccl_timeout_s: int | None  # None: `watchdog.collective_timeout_s` decides
    max_restarts: int
    ft: FtConfig
    record: dict[str, Any]  # the whole config, as the wandb run records it
    replica: int | None = None  # ft: this replica group's index (launcher/replicas.py); None: ft off

    @property
    def predicted_step_s(self) -> float:
        """The planner's step time (0.0 without a prediction): the watchdog's timeout follows it."""
        return self.prediction.step_time_s if self.prediction else 0.0
