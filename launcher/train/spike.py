"""Loss spikes (`guard.spike`): a finite step whose loss or gradient norm jumps far above its recent level.

A spike is a step whose loss or gradient norm (before clipping) exceeds `guard.spike_factor` x its median
over the last `guard.window` steps counted; steps up to `guard.warmup` are neither checked nor counted, and
checking starts once the window is full. Only steps that trained enter the window. Like the non-finite
guard (guard.py), the check reads the two floats the loop already holds, each already the same on every
rank: every rank decides alike, with no collective and no host sync of its own.

`skip` drops that step's update (the step, its batch and its learning rate are spent, like
`optim.skip_nonfinite`). `rollback` puts back the last in-memory snapshot (step r) and never serves the
global batches r+1 .. s (s: the spiking step's batch) again: the batches that led up to the spike as well
as the spiking one, since rerunning the same batches from the same state would rebuild the same state.
Skipped batches consume no steps: the run goes on from step r+1 with batch s+1, the learning rate of step
r+1, and still trains `steps` updates, exactly as a run whose data never held those batches
(`guard.skip_batches=[[r+1,s]]`). After `guard.max_rollbacks` rollbacks the next spike stops the run
(exit 3, one line naming the last checkpoint): spikes that keep coming need a lower learning rate or other
data, not more rollbacks.

The snapshot: each rank's own shards of the model (parameters and buffers) and of the optimizer state, the
optimizer's hyperparameters, the schedule, the RNG states and the detector's window, and the data position
(where the skipped batches begin: the loader itself stays where it is, just before the next batch kept);
taken before the first step, every `guard.snapshot_every` steps and at every checkpoint step (so a
rollback never goes behind the newest checkpoint), into buffers reused from one snapshot to the next, in
host memory or on the device (`guard.snapshot`). Each event is a console line and a metrics.jsonl row.

`SpikeGuard` is a hook of the step (launcher/train/hooks.py): the snapshot before a step, the check at
`allow_update`. Tests poison batches through `LAUNCHER_TEST_SPIKE=BATCH[,BATCH...]` (launcher/train/faults.py):
while a named global batch trains, the final norm's output is scaled, so the logits, the loss and the
gradients spike.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.config.schema import GuardConfig
from launcher.errors import NonFinite
from launcher.train.checkpoint import rng_states, set_rng_states
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.faults import fault_plan
from launcher.train.hooks import Hook, Step
from launcher.train.pinned import shared_buffers

if TYPE_CHECKING:
    from launcher.data import BatchLoader
    from launcher.metrics.console import ConsoleView
    from launcher.train.checkpoint import Checkpointer, Stateful

log = logging.getLogger("launcher")
POISON_SCALE = 50.0  # logits x50: the loss and the gradient norm rise far beyond any sensible factor


class Detector:
    """The loss and the gradient norm of the last `window` steps counted, and the spike rule on them."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.factor, self.warmup = cfg.spike_factor, cfg.warmup
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.norms: deque[float] = deque(maxlen=cfg.window)

    def ratio(self, step: int, loss: float, grad_norm: float) -> float | None:
        """How many times its median this step's loss or gradient norm is (the larger) when that is above
        the factor; None for a step that is no spike or not checked."""
        if step <= self.warmup or len(self.losses) < (self.losses.maxlen or 0):
            return None
        ratio = max(times_median(loss, self.losses), times_median(grad_norm, self.norms))
        return ratio if ratio > self.factor else None

    def add(self, step: int, loss: float, grad_norm: float) -> None:
        if step > self.warmup:
            self.losses.append(loss)
            self.norms.append(grad_norm)

    def state_dict(self) -> dict[str, list[float]]:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        for window, key in ((self.losses, "losses"), (self.norms, "norms")):
            window.clear()
            window.extend(state[key])


def times_median(value: float, window: deque[float]) -> float:
    """`value` over the window's median (a median of 0, e.g. no gradient: infinite above it)."""
    median = statistics.median(window)
    return value / median if median > 0 else (math.inf if value > 0 else 0.0)


@dataclass
class Trainee:
    """What a rollback puts back (besides the detector's window)."""

    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    loader: BatchLoader
    device: torch.device


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: copying into it writes the parameter), else the tensor."""
    return t.detach().to_local() if isinstance(t, DTensor) else t.detach()


def model_tensors(parts: list[nn.Module]) -> list[torch.Tensor]:
    return [local(t) for part in parts for t in (*part.parameters(), *part.buffers())]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor in a fixed order (empty before the first update: AdamW builds its state lazily)."""
    state = optimizer.state
    found = (v for group in optimizer.param_groups for p in group["params"] for v in state.get(p, {}).values())
    return [local(v) for v in found if isinstance(v, torch.Tensor)]


def copy_into(saved: list[torch.Tensor], live: list[torch.Tensor], where: torch.device) -> list[torch.Tensor]:
    """`live` copied into `saved`, made on `where` (`shared_buffers`) when the tensors differ (the first snapshot;
    the first after AdamW built its state); host buffers are pinned on CUDA, where copies run at full speed."""
    if [(s.shape, s.dtype) for s in saved] != [(t.shape, t.dtype) for t in live]:
        saved = shared_buffers(live, where, pin=where.type == "cpu" and any(t.is_cuda for t in live))
    for s, t in zip(saved, live, strict=True):
        s.copy_(t, non_blocking=True)
    return saved


class Snapshot:
    """One copy of a rank's training state at a step, kept in memory on `where`."""

    def __init__(self, where: torch.device) -> None:
        self.where, self.step = where, -1
        self.model: list[torch.Tensor] = []
        self.optim: list[torch.Tensor] = []
        self.rest: dict[str, Any] = {}

    @torch.no_grad()
    def take(self, step: int, state: Trainee, detector: Detector) -> None:
        self.model = copy_into(self.model, model_tensors(state.parts), self.where)
        self.optim = copy_into(self.optim, optimizer_tensors(state.optimizer), self.where)
        groups = [{k: v for k, v in group.items() if k != "params"} for group in state.optimizer.param_groups]
        rest = {"groups": groups, "schedule": state.schedule.state_dict(), "detector": detector.state_dict()}
        self.rest = copy.deepcopy(rest) | {"position": state.loader.position, "rng": rng_states(state.device)}
        if state.device.type == "cuda":  # the copies ran asynchronously; the next update overwrites their source
            torch.cuda.synchronize(state.device)
        self.step = step

    @torch.no_grad()
    def restore(self, state: Trainee, detector: Detector) -> int:
        """Put the state back; return the snapshot's step. The loader stays where it is: the caller skips
        every batch from the snapshot's position to it."""
        for live, saved in zip(model_tensors(state.parts), self.model, strict=True):
            live.copy_(saved)
        if self.optim:
            for live, saved in zip(optimizer_tensors(state.optimizer), self.optim, strict=True):
                live.copy_(saved)
        else:  # taken before the first update
            state.optimizer.state.clear()
        rest = copy.deepcopy(self.rest)  # loading takes from the dicts it is given
        for group, saved in zip(state.optimizer.param_groups, rest["groups"], strict=True):
            group.update(saved)
        state.schedule.load_state_dict(rest["schedule"])
        detector.load_state_dict(rest["detector"])
        set_rng_states(rest["rng"], state.device)
        return self.step

    def state_dict(self) -> dict[str, Any]:
        """The snapshot as it is (its tensors, not copies): what a replica group healing from this one takes."""
        return {"step": self.step, "model": self.model, "optim": self.optim, "rest": self.rest}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A peer's snapshot copied into this one's buffers on `where`."""
        self.model = copy_into(self.model, state["model"], self.where)
        self.optim = copy_into(self.optim, state["optim"], self.where)
        self.rest, self.step = copy.deepcopy(state["rest"]), state["step"]
        if self.where.type == "cuda":  # the copies ran asynchronously
            torch.cuda.synchronize(self.where)


def skipped(pairs: Sequence[Sequence[int]]) -> int:
    return sum(b - a + 1 for a, b in pairs)


class SpikeGuard(Hook):
    """`guard.spike` for the loop: checks each finite step, skips or rolls back a spike, keeps the snapshot.
    `resumed`: the checkpoint this run resumed from (its detector window and rollback count)."""

    def __init__(
        self,
        cfg: GuardConfig,
        state: Trainee,
        checkpointer: Checkpointer,
        sinks: Sequence[Any],
        view: ConsoleView,
        resumed: Stateful | None,
    ) -> None:
        self.cfg, self.state, self.checkpointer, self.sinks, self.view = cfg, state, checkpointer, sinks, view
        self.detector = Detector(cfg)
        self.rollbacks = 0
        if resumed is not None and "spike" in resumed.extras:
            self.load_state_dict(resumed.extras["spike"])
        new = [pair for pair in cfg.skip_batches if pair not in state.loader.skipped]
        state.loader.skipped += new
        if new:  # an action the run would otherwise take silently
            ranges = ", ".join(f"{a:,}-{b:,}" if a != b else f"{a:,}" for a, b in new)
            view.note(f"guard.skip_batches: global batches {ranges} will not be trained on ({skipped(new):,} batches)")
        where = state.device if cfg.snapshot == "device" else torch.device("cpu")
        self.snapshot = Snapshot(where) if cfg.spike == "rollback" else None
        self.rolled_back_to: int | None = None  # set by `update` on a rollback: the step the loop goes on from
        self.poison = fault_plan().spike_batches()

    def before_step(self, s: Step) -> None:
        self.keep(s.number - 1, s.last)

    def during_forward(self, s: Step) -> contextlib.AbstractContextManager:
        return self.poisoned(self.state.parts)

    def allow_update(self, s: Step) -> bool:
        allowed = self.update(s.number, s.loss, s.grad_norm)
        if self.rolled_back_to is not None:
            s.redo = self.rolled_back_to
        return allowed

    def extras(self) -> dict[str, Any]:
        return {"spike": self.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint's extras (the skipped batches are in the loader's)."""
        return {"window": self.detector.state_dict(), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["window"])
        self.rollbacks = state["rollbacks"]

    def peer_state(self) -> dict[str, Any]:
        """What a replica group healing from this one receives (`ft`, launcher/train/replicas.py), so that both
        decide every later step alike: the window and rollback count, and under `rollback` the snapshot."""
        snapshot = {"snapshot": self.snapshot.state_dict()} if self.snapshot is not None else {}
        return self.state_dict() | snapshot

    def load_peer_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        if self.snapshot is not None:
            self.snapshot.load_state_dict(state["snapshot"])

    def keep(self, step: int, last_step: int) -> None:
        """Before step+1: snapshot when none is kept yet, every `snapshot_every` steps and at checkpoint steps."""
        snap = self.snapshot
        if snap is None or snap.step == step:
            return
        if snap.step < 0 or step % self.cfg.snapshot_every == 0 or self.checkpointer.due(step, last_step):
            snap.take(step, self.state, self.detector)

    def update(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether this finite step's update may be applied: False for a spike, skipped or rolled back
        (then `rolled_back_to` is the snapshot's step); raises NonFinite past `max_rollbacks`."""
        self.rolled_back_to = None
        ratio = None if self.cfg.spike == "off" else self.detector.ratio(step, loss, grad_norm)
        if ratio is None:
            self.detector.add(step, loss, grad_norm)
            return True
        row = {"step": step, "loss": loss, "grad_norm": grad_norm, "spike_factor": ratio, "spike": self.cfg.spike}
        batch = self.state.loader.batch_number
        if self.snapshot is None:  # skip
            self.report(row | {"skipped_batches": [batch, batch]}, "update skipped")
            return False
        if self.rollbacks == self.cfg.max_rollbacks:
            self.checkpointer.wait()  # an async save in flight holds an earlier, good step: complete it
            kept = complete_checkpoints(self.checkpointer.root)
            raise NonFinite(
                f"loss spike at step {step} ({ratio:.1f}x its median) with guard.max_rollbacks="
                f"{self.cfg.max_rollbacks} rollbacks done: lower optim.lr or raise guard.max_rollbacks; "
                f"last checkpoint: {kept[0] if kept else 'none'}"
            )
        self.rollbacks += 1
        first = self.snapshot.rest["position"] // self.state.loader.global_batch + 1
        self.state.loader.skipped.append([first, batch])
        self.rolled_back_to = self.snapshot.restore(self.state, self.detector)
        what = f"rolled back to step {self.rolled_back_to}, batches {first}-{batch} skipped"
        self.report(row | {"skipped_batches": [first, batch], "restored_step": self.rolled_back_to}, what)
        return False

    def report(self, row: dict[str, Any], what: str) -> None:
        """One console line, one metrics row, one line in every rank's log."""
        line = (
            f"loss spike at step {row['step']}: loss {row['loss']:.4g}, grad norm {row['grad_norm']:.4g}, "
            f"{row['spike_factor']:.1f}x the median of the last {self.cfg.window} steps; {what}"
        )
        log.warning("%s", line)
        self.view.note(line)
        for sink in self.sinks:
            sink.log(row)

    def poisoned(self, parts: list[nn.Module]) -> contextlib.AbstractContextManager:
        """Tests: around the forward of a batch the fault plan names (the loader served it last)."""
        poisoned = self.state.loader.batch_number in self.poison
        return scaled_output(parts, POISON_SCALE) if poisoned else contextlib.nullcontext()


@contextlib.contextmanager
def scaled_output(parts: list[nn.Module], scale: float) -> Iterator[None]:
    """The final norm's output (on the rank holding it) times `scale` for the duration: the logits too."""
    hook = lambda module, args, out: out * scale  # noqa: E731
    handles = [part.norm.register_forward_hook(hook) for part in parts if getattr(part, "norm", None) is not None]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
