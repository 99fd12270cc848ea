"""Issue 29 figures: what `ft` (torchft replica groups) costs when nothing fails, and what one failure
costs with and without it. Same layout on both sides: 2 data-parallel ranks of one rank each, gloo.

- Overhead: the median span between consecutive step ends (metrics.jsonl, every step logged) after
  WARMUP steps, ft (2 groups x 1 rank, ft.min_replicas=2) over plain DDP, in alternating rounds.
- One failure: a worker killed at step KILL. Plain: the elastic agent restarts both ranks from the
  checkpoint before it (checkpoint.every=EVERY); time lost: from step KILL's first end to its second,
  in median step spans. ft: group 1 dies there (LAUNCHER_TEST_KILL), its agent restarts it and it
  heals from group 0, which steps on alone; lost: group 0's longest span beyond the median, plus the
  batches group 1 missed (ft_tokens_missed) in whole steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from launcher.launch.spawn import launch
from launcher.train.faults import TEST_KILL_ENV
from tests.conftest import run_for, tiny_config, worker_pids

WARMUP, KILL, EVERY = 5, 40, 25
FT = ("ft.replicas=2", "ft.min_replicas=2", "ft.quorum_timeout_s=30")


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def spans(rows: list[dict[str, Any]]) -> list[float]:
    return [b["time"] - a["time"] for a, b in zip(rows[WARMUP:], rows[WARMUP + 1 :], strict=False)]


def train(tmp: Path, name: str, shape: tuple[str, ...], *extra: str) -> tuple[dict[str, Any], Path]:
    layout = ("dp=2", "dp_replicate=2", "dp_shard=1", "metrics.log_every=1", *shape)
    run_dir = tmp / name
    return launch(run_for(tiny_config(tmp, *layout, *extra), None), run_dir), run_dir


def kill_a_worker_at(run_dir: Path, step: int) -> threading.Thread:
    """Plain side: SIGKILL one local worker once the owner has logged `step`."""

    def watch() -> None:
        metrics = run_dir / "metrics.jsonl"  # a line being written is complete: the sink flushes lines
        while not (metrics.exists() and any(row["step"] >= step for row in rows_of(run_dir))):
            time.sleep(0.01)
        os.kill(max(worker_pids(os.getpid())), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def overhead(tmp: Path, shape: tuple[str, ...], rounds: int) -> tuple[float, float]:
    """Median step span (s) of plain DDP and of ft, over `rounds` alternating rounds."""
    plain, ft = [], []
    for i in range(rounds):
        for side, extra in ((plain, ()), (ft, FT))[:: 1 if i % 2 == 0 else -1]:
            _, run_dir = train(tmp, f"{'ft' if extra else 'plain'}{i}", shape, "checkpoint.every=0", *extra)
            side += spans(rows_of(run_dir))
    return statistics.median(plain), statistics.median(ft)


def one_failure(tmp: Path, shape: tuple[str, ...], step_s: float, tokens_per_step: int) -> list[float]:
    """Steps lost to one killed worker: plain DDP (restart from a checkpoint); ft (heal from a peer):
    group 0's stall, and the steps' worth of batches group 1 missed."""
    run_dir = tmp / "plain_kill"
    kill_a_worker_at(run_dir, KILL)
    train(tmp, "plain_kill", shape, f"checkpoint.every={EVERY}", "max_restarts=1")
    ends = [row["time"] for row in rows_of(run_dir) if row["step"] == KILL]
    plain_lost = (ends[-1] - ends[0]) / step_s
    os.environ[TEST_KILL_ENV] = f"{KILL}:1"
    try:
        ft = ("ft.replicas=2", "ft.min_replicas=1", "ft.quorum_timeout_s=30", "max_restarts=1")
        summary, run_dir = train(tmp, "ft_kill", shape, "checkpoint.every=0", *ft)
    finally:
        os.environ.pop(TEST_KILL_ENV)
    stall = max(spans(rows_of(run_dir))) - step_s
    return [plain_lost, stall / step_s, summary["ft_tokens_missed"] / tokens_per_step]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench ft")
    parser.add_argument("--rounds", type=int, default=2, help="alternating plain/ft rounds")
    parser.add_argument("--steps", type=int, default=300, help="enough for a restarted group to return")
    parser.add_argument("--micro", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    shape = (f"steps={args.steps}", f"batch.micro={args.micro}", f"seq_len={args.seq}")
    with tempfile.TemporaryDirectory() as tmp:
        plain_s, ft_s = overhead(Path(tmp), shape, args.rounds)
        plain_lost, stalled, missed = one_failure(Path(tmp), shape, plain_s, 2 * args.micro * args.seq)
    table = Table(title=f"ft: tiny model, 2 x 1 rank, gloo, micro {args.micro} x seq {args.seq}")
    for column in ("figure", "plain DDP", "ft (torchft)", "ft / plain"):
        table.add_column(column)
    table.add_row("median step (ms)", f"{plain_s * 1e3:.1f}", f"{ft_s * 1e3:.1f}", f"{ft_s / plain_s:.3f}")
    lost = f"{stalled + missed:.1f} ({stalled:.1f} stalled + {missed:.1f} missed)"
    table.add_row(f"steps lost to one kill (step {KILL})", f"{plain_lost:.1f}", lost, "")
    Console().print(table)
