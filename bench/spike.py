"""Issue 25 figures: what `guard.spike=rollback` costs. The in-memory snapshot (model + AdamW state, taken
every `guard.snapshot_every` steps) against reloading the newest checkpoint from disk, which a rollback
from disk would need; and the detector's time per step, beside a step of the same model."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from launcher.config.schema import compose_config as make_config
from launcher.data import BatchLoader
from launcher.model.init import initialized_model
from launcher.train.checkpoint import Checkpointer, Stateful
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.optim import build_optimizer
from launcher.train.spike import Detector, Snapshot, Trainee


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def trainee(model_name: str) -> tuple[Trainee, float]:
    """A model after one AdamW step (its moments exist, as mid-run), and one training step's time
    (8 sequences of 128 tokens)."""
    cfg = make_config(f"+model={model_name}")
    model = initialized_model(cfg.model, cfg.seed, torch.device("cpu"))
    optimizer, schedule = build_optimizer([model], cfg.optim, 10)
    tokens = torch.randint(0, cfg.model.vocab_size, (8, 128))

    def step() -> None:
        model(tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    loader = BatchLoader(np.zeros(1000, dtype=np.uint16), 128, 8)
    return Trainee([model], optimizer, schedule, loader, torch.device("cpu")), median_s(step, 1)


def snapshot_row(model_name: str, tmp: Path) -> list[str]:
    state, step_s = trainee(model_name)
    snap, detector = Snapshot(torch.device("cpu")), Detector(make_config().guard)
    first = median_s(lambda: snap.take(1, state, detector), 1)  # allocates its buffers
    mib = sum(t.numel() * t.element_size() for t in (*snap.model, *snap.optim)) / 2**20
    take = median_s(lambda: snap.take(1, state, detector), 5)
    restore = median_s(lambda: snap.restore(state, detector), 5)
    ckpt = Checkpointer(make_config().checkpoint, tmp / model_name, 0)
    ckpt.save(state.parts, state.optimizer, Stateful(1, {}))
    path = complete_checkpoints(tmp / model_name)[0]
    reload = median_s(lambda: ckpt.load([path], state.parts, state.optimizer), 3)
    ms = [f"{1e3 * s:,.1f}" for s in (first, take, restore, reload, step_s)]
    return [model_name, f"{mib:,.1f}", *ms, f"{reload / restore:,.0f}x"]


def detector_us(window: int = 50) -> float:
    """Microseconds per step of what `SpikeGuard.update` adds (the check and the window's update), the
    window full and no spike."""
    detector = Detector(make_config("guard.warmup=0", f"guard.window={window}").guard)
    for step in range(1, window + 1):
        detector.add(step, 3.0 + step % 3, 1.0)

    def steps() -> None:
        for step in range(window + 1, window + 1001):
            detector.ratio(step, 3.0, 1.0)
            detector.add(step, 3.0, 1.0)

    return 1e6 * median_s(steps, 5) / 1000


def main(argv: list[str]) -> None:
    console = Console()
    with tempfile.TemporaryDirectory() as name:
        table = Table(
            title="guard.spike=rollback, one process on this CPU: the in-memory snapshot vs reloading a checkpoint"
        )
        cols = (
            "model",
            "snapshot MiB",
            "first ms",
            "snapshot ms",
            "restore ms",
            "disk reload ms",
            "step ms",
            "reload/restore",
        )
        for col in cols:
            table.add_column(col, justify="right")
        for model in ("tiny", "small", "125m"):
            table.add_row(*snapshot_row(model, Path(name)))
        console.print(table)
    console.print(f"spike detector: {detector_us():.1f} us per step (window of 50, no spike)")
