"""The step's hooks: what is not the step itself joins it at fixed moments.

The loop (launcher/train/loop.py) is the spine: data -> forward/backward -> update -> metrics. Resilience
(the watchdog's phases, preemption, ft's replica groups, the non-finite guard, the spike guard) and
observers (profiler, per-source losses, MoE load, fp8 scales) are `Hook` objects, one per concern, built
from the Run in setup (launcher/train/setup.py: `hooks_for`, the one list and its order). The loop calls
every hook at each moment, in that order:

    before_step     the step begins; its batch is not drawn yet (the step's timer not started)
    during_forward  a context around forward and backward
    after_backward  `s.loss` is this step's; a hook may replace it (ft: the mean over replica groups)
    allow_update    `s.grad_norm` too: whether the optimizer may step (the first False ends the asking);
                    a hook that drops the step sets `s.redo`, the step the loop goes on from
    after_update    the optimizer stepped (`s.updated`) or not; the step counts unless `s.redo` is set
    after_step      the step's work is done (and the device synced); a counted step's row takes the
                    hooks' columns in `s.row`
    before_eval, before_save   the loop evaluates, or saves a checkpoint (and, at the end, waits for one)
    at_end          training is over (`stopped`: by a stop signal, every rank saved)

and asks them for what the run keeps: `extras` (into each checkpoint; a hook reads its own back from the
checkpoint it resumes), `summary` (into summary.json), `stop_requested` and `ended`. Every method is a
no-op by default. No torch here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.train.preemption import PreemptionFlag
    from launcher.train.watchdog import Off, Watchdog


@dataclass
class Step:
    """One step as the loop and its hooks see it."""

    number: int  # ft: a group that healed from a peer moves to the peer's step (in `allow_update`)
    last: int  # the run's last step
    loss: float = math.nan
    grad_norm: float = math.nan
    updated: bool = False  # the optimizer stepped
    redo: int | None = None  # set when this step does not count: the step the loop goes on from
    row: dict[str, Any] = field(default_factory=dict)  # the hooks' columns of this step's metrics row
    loads: list[Any] = field(default_factory=list)  # MoE: each layer's load, for the panel and wandb

    @property
    def counted(self) -> bool:
        return self.redo is None


class Hook:
    """One concern at the step's fixed moments. Subclass it and override the moments you need."""

    ended = False  # ft: another group finished the run before this one (re)started: nothing left to train

    @property
    def stop_requested(self) -> bool:
        """This rank was asked to stop (a signal): every rank saves at this step and stops."""
        return False

    def before_step(self, s: Step) -> None:
        pass

    def during_forward(self, s: Step) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_backward(self, s: Step) -> None:
        pass

    def allow_update(self, s: Step) -> bool:
        return True

    def after_update(self, s: Step) -> None:
        pass

    def after_step(self, s: Step) -> None:
        pass

    def before_eval(self, s: Step) -> None:
        pass

    def before_save(self, step: int) -> None:
        pass

    def at_end(self, stopped: bool) -> None:
        pass

    def extras(self) -> dict[str, Any]:
        """What a checkpoint keeps of this hook (read back by the hook built from the resumed checkpoint)."""
        return {}

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """This hook's entries in summary.json, from the run's metrics rows."""
        return {}


class Hooks:
    """The run's hooks in their order, called together at each moment."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks = list(hooks)

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    @property
    def ended(self) -> bool:
        return any(h.ended for h in self.hooks)

    @property
    def stop_requested(self) -> bool:
        return any(h.stop_requested for h in self.hooks)

    def before_step(self, s: Step) -> None:
        for h in self.hooks:
            h.before_step(s)

    @contextlib.contextmanager
    def during_forward(self, s: Step) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.during_forward(s))
            yield

    def after_backward(self, s: Step) -> None:
        for h in self.hooks:
            h.after_backward(s)

    def allow_update(self, s: Step) -> bool:
        return all(h.allow_update(s) for h in self.hooks)  # in order: a refusal ends the asking

    def after_update(self, s: Step) -> None:
        for h in self.hooks:
            h.after_update(s)

    def after_step(self, s: Step) -> None:
        for h in self.hooks:
            h.after_step(s)

    def before_eval(self, s: Step) -> None:
        for h in self.hooks:
            h.before_eval(s)

    def before_save(self, step: int) -> None:
        for h in self.hooks:
            h.before_save(step)

    def at_end(self, stopped: bool) -> None:
        for h in self.hooks:
            h.at_end(stopped)

    def extras(self) -> dict[str, Any]:
        return {k: v for h in self.hooks for k, v in h.extras().items()}

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: v for h in self.hooks for k, v in h.summary(rows).items()}


class Phases(Hook):
    """The watchdog (launcher/train/watchdog.py): where this rank is, at each moment of the step."""

    def __init__(self, watchdog: Watchdog | Off) -> None:
        self.watchdog = watchdog

    def before_step(self, s: Step) -> None:
        self.watchdog.phase("data", s.number)

    @contextlib.contextmanager
    def during_forward(self, s: Step) -> Iterator[None]:
        self.watchdog.phase("forward_backward", s.number)
        yield

    def after_backward(self, s: Step) -> None:
        self.watchdog.phase("optimizer", s.number)

    def before_eval(self, s: Step) -> None:
        self.watchdog.phase("eval", s.number)

    def before_save(self, step: int) -> None:
        self.watchdog.phase("checkpoint", step)


class Preemption(Hook):
    """SIGINT/SIGTERM/SIGUSR1 (launcher/train/preemption.py): every rank saves at the same step, then stops.
    The loop gathers every rank's request with its memory figure, in the one collective of each step."""

    def __init__(self, flag: PreemptionFlag) -> None:
        self.flag = flag

    @property
    def stop_requested(self) -> bool:
        return self.flag.raised

    def at_end(self, stopped: bool) -> None:
        self.flag.restore()
