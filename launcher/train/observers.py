"""The step's observers, each a hook (launcher/train/hooks.py): the profiler's window, a mixture's losses per
source, MoE routing balance, FSDP2's float8 weight scales. Each is built only when its feature is on
(setup.hooks_for)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from launcher.metrics import sources
from launcher.parallel.float8 import precompute_scales
from launcher.train.hooks import Hook, Step

if TYPE_CHECKING:
    import torch

    from launcher.config.options import Fp8Options
    from launcher.data import BatchLoader
    from launcher.metrics.console import ConsoleView
    from launcher.metrics.profile import StepProfiler
    from launcher.parallel.runner import Runner

log = logging.getLogger("launcher")


class Profiled(Hook):
    """`profile.start`: the steps of the window marked and traced; every rank's top ops at the end."""

    def __init__(self, profiler: StepProfiler, view: ConsoleView) -> None:
        self.profiler, self.view = profiler, view
        self.lines: list[str] = []

    def before_step(self, s: Step) -> None:
        self.profiler.begin(s.number)

    def after_step(self, s: Step) -> None:
        self.profiler.end(s.number)

    def at_end(self, stopped: bool) -> None:
        if stopped:  # a stop signal: no summary lines (a collective), the window stays unwritten
            return
        self.lines = self.profiler.finish()  # every rank's top ops, one line each
        for line in self.lines:
            self.view.note(line)
            log.info("profile %s", line)

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"profile": self.lines} if self.lines else {}


class SourceLosses(Hook):
    """data=mix: each source's loss and tokens every step, from the per-token losses the pass computes anyway."""

    def __init__(self, runner: Runner, loader: BatchLoader) -> None:
        self.runner, self.loader = runner, loader
        self.recorded: list[torch.Tensor] | None = None
        self.table: torch.Tensor | None = None

    @contextlib.contextmanager
    def during_forward(self, s: Step) -> Iterator[None]:
        with sources.recording(self.loader) as per_token:
            yield
        self.recorded = per_token

    def after_backward(self, s: Step) -> None:
        self.table = sources.sums(self.runner, self.loader, self.recorded)  # one small all-reduce
        self.recorded = None

    def after_step(self, s: Step) -> None:
        if s.counted:
            s.row |= sources.figures(self.loader, self.table)

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return sources.realised_shares(rows)  # each source's tokens and share over the run


class MoeBalance(Hook):
    """MoE: the routing biases moved towards balance after every counted step; the balance metrics, and with
    `per_layer` each layer's load (the panel and wandb: not kept in the rows)."""

    def __init__(self, runner: Runner, per_layer: bool) -> None:
        self.runner, self.per_layer = runner, per_layer

    def after_update(self, s: Step) -> None:
        if s.counted:
            s.row |= self.runner.update_balance(self.per_layer)
            s.loads = s.row.pop("moe_layers", [])

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: v for k, v in rows[-1].items() if k.startswith("moe_")} if rows else {}  # at the last step


class Fp8Scales(Hook):
    """FSDP2's float8 all-gather: the weight scales for the next step, after every change to the weights
    (an update; a step dropped: a rollback's restored weights, an ft peer's)."""

    def __init__(self, parts: list[torch.nn.Module], fp8: Fp8Options) -> None:
        self.parts, self.fp8 = parts, fp8

    def after_update(self, s: Step) -> None:
        if s.updated or not s.counted:
            precompute_scales(self.parts, self.fp8)
