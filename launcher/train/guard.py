"""The non-finite guard: a step whose loss or gradient norm is NaN or infinite never reaches the
optimizer. By default the run stops there (`NonFinite`, exit 3) naming the step, the rank whose own
loss went bad first, and the last good checkpoint, which stays as it is (nothing is saved after the
bad step); with `optim.skip_nonfinite=true` the update is skipped and counted instead.

No extra host sync per step: the check reads the loss and the gradient norm the loop already has as
floats, each the result of a sum over every rank (the runner's global mean, the global norm), so
every rank sees the same values and takes the same branch: their collectives stay matched. Only on
a bad step do the ranks meet once more, to find which rank's own loss was not finite.

Both are hooks of the step (launcher/train/hooks.py): `Guard` asks at `allow_update`; `InjectedNan` (tests
only, `LAUNCHER_TEST_NAN=STEP[:RANK]`, launcher/train/faults.py) turns that rank's forward output NaN at
that step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from launcher.errors import NonFinite
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.faults import fault_plan
from launcher.train.hooks import Hook, Step
from launcher.train.preemption import collective_device

if TYPE_CHECKING:
    from launcher.parallel.runner import Runner
    from launcher.train.checkpoint import Checkpointer, Stateful


class Guard(Hook):
    """`resumed`: the checkpoint this run resumed from (its count of skipped steps)."""

    def __init__(
        self, skip: bool, rank: int, checkpointer: Checkpointer, runner: Runner, resumed: Stateful | None = None
    ) -> None:
        self.skip, self.rank, self.checkpointer, self.runner = skip, rank, checkpointer, runner
        self.skipped = resumed.extras.get("skipped_steps", 0) if resumed is not None else 0  # steps skipped so far

    def allow_update(self, s: Step) -> bool:
        return self.update(s.number, s.loss, s.grad_norm, self.runner)

    def after_step(self, s: Step) -> None:
        if self.skip and s.counted:
            s.row["skipped_steps"] = self.skipped

    def extras(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped}

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"skipped_steps": self.skipped}

    def update(self, step: int, loss: float, grad_norm: float, runner: Runner) -> bool:
        """Whether this step's gradients may update the model: True when finite; False when skipped
        (`optim.skip_nonfinite`); otherwise raises NonFinite after any checkpoint in flight is done."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return True
        if self.skip:
            self.skipped += 1
            return False
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        rank = first_bad_rank(runner.local_loss, self.rank)
        self.checkpointer.wait()  # an async save in flight holds an earlier, good step: complete it
        kept = complete_checkpoints(self.checkpointer.root)
        last = kept[0] if kept else "none"
        raise NonFinite(f"non-finite {what} at step {step} on rank {rank}; last checkpoint: {last}")


def first_bad_rank(local_loss: float, rank: int) -> int:
    """The lowest rank whose own loss is not finite (every rank calls this on the same step); when every
    rank's own loss is finite (a gradient overflowed), the lowest rank."""
    if not dist.is_initialized():
        return rank
    bad = torch.tensor([0 if math.isfinite(local_loss) else 1], device=collective_device())
    flags = [torch.zeros_like(bad) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, bad)
    return next((r for r, flag in enumerate(flags) if flag.item()), 0)


class InjectedNan(Hook):
    """Tests only: the step whose model output turns NaN on this rank (`LAUNCHER_TEST_NAN`, read once)."""

    def __init__(self, parts: list[torch.nn.Module], rank: int) -> None:
        self.parts, self.step = parts, fault_plan().nan_step(rank)

    def during_forward(self, s: Step) -> contextlib.AbstractContextManager[None]:
        return injected_nan(self.parts, s.number == self.step)


@contextlib.contextmanager
def injected_nan(parts: list[torch.nn.Module], now: bool) -> Iterator[None]:
    """With `now`, the first part's output is NaN for the duration."""
    if not now:
        yield
        return
    handle = parts[0].register_forward_hook(lambda module, args, out: out + float("nan"))
    try:
        yield
    finally:
        handle.remove()
