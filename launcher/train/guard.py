"""The non-finite guard: a step whose loss or gradient norm is NaN or infinite never reaches the
optimizer. By default the run stops there (`NonFinite`, exit 3) naming the step, the rank whose own
loss went bad first, and the last good checkpoint, which stays as it is (nothing is saved after the
bad step); with `optim.skip_nonfinite=true` the update is skipped and counted instead.

No extra host sync per step: the check reads the loss and the gradient norm the loop already has as
floats, each the result of a sum over every rank (the runner's global mean, the global norm), so
every rank sees the same values and takes the same branch: their collectives stay matched. Only on
a bad step do the ranks meet once more, to find which rank's own loss was not finite.

Tests inject a NaN through `LAUNCHER_TEST_NAN=STEP[:RANK]` (read here only): that rank's forward
output at that step becomes NaN.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from launcher.errors import NonFinite
from launcher.train.checkpoint import complete_checkpoints
from launcher.train.preemption import collective_device

if TYPE_CHECKING:
    from launcher.parallel.runner import Runner
    from launcher.train.checkpoint import Checkpointer

TEST_NAN_ENV = "LAUNCHER_TEST_NAN"


class Guard:
    def __init__(self, skip: bool, rank: int, checkpointer: Checkpointer) -> None:
        self.skip, self.rank, self.checkpointer = skip, rank, checkpointer
        self.skipped = 0  # steps skipped so far in this run (the loop resumes the checkpoint's count)

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


def injected_nan_step(rank: int) -> int | None:
    """Tests only: the step whose model output turns NaN on this rank (LAUNCHER_TEST_NAN=STEP[:RANK]),
    read once before the loop."""
    at, _, who = os.environ.get(TEST_NAN_ENV, "").partition(":")
    return int(at) if at and int(who or 0) == rank else None


@contextlib.contextmanager
def injected_nan(parts: list[torch.nn.Module], now: bool) -> Iterator[None]:
    """With `now`, the first part's output is NaN for the duration (the step `injected_nan_step` named)."""
    if not now:
        yield
        return
    handle = parts[0].register_forward_hook(lambda module, args, out: out + float("nan"))
    try:
        yield
    finally:
        handle.remove()
