"""What gpu_check's checks share (bench/gpu_check.py, bench/gpu_fp8.py): the row a check returns, what
the checks run on, each check's clock, `train` run as a user runs it, and the readings of its files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUIET = ("eval.every=0", "metrics.wandb.mode=disabled", "metrics.console=plain", "resume=never")


@dataclass
class Check:
    name: str
    result: str  # ok | FAIL | below goal | skipped
    note: str
    figures: dict[str, Any] = field(default_factory=dict)  # tokens_per_s, tflops, mfu, peak_gib, planned_gib


@dataclass(frozen=True)
class Target:
    """What the checks run: one GPU and the models that fill it, or this CPU with tiny ones (rehearsal)."""

    hardware: tuple[str, ...]
    cuda: bool
    big: tuple[str, ...]  # throughput
    warmup: int  # steps left out of throughput (compile, allocator)
    small: tuple[str, ...]  # fsdp, resume, profile
    build: tuple[str, ...]
    moe: tuple[str, ...]
    experts: dict[str, int]  # the grouped-GEMM comparison's shapes
    goal: float | None
    fp8: tuple[str, ...]  # the fp8 row's run: the throughput model's arguments with these instead of its dtype


class Clock:
    """Seconds left for one check: the lesser of its budget and the overall deadline."""

    def __init__(self, deadline: float, budget: float) -> None:
        self.end = min(deadline, time.monotonic() + budget)

    def left(self) -> float:
        return max(1.0, self.end - time.monotonic())


def failure_line(output: str) -> str:
    """The line that says what went wrong: our `error:` line, a traceback's last line, else the last line
    that is not a warning."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    for pattern in (r"^error: ", r"^[\w.]*(Error|Exception|Interrupt)\b"):
        found = [line for line in lines if re.match(pattern, line)]
        if found:
            return found[-1][:300]
    plain = [line for line in lines if "warn" not in line.lower()]
    return (plain or lines or ["no output"])[-1][:300]


def run_logged(cmd: list[str], log: Path, clock: Clock) -> tuple[int, str]:
    """A command with the clock's timeout, its output kept in `log`: (exit code, what went wrong)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=clock.left())
    except subprocess.TimeoutExpired as err:
        log.write_text("".join(text(part) for part in (err.stdout, err.stderr)))
        return 124, f"timed out after {err.timeout:.0f} s (the check's budget or --deadline; its output: {log})"
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode, failure_line(proc.stderr + "\n" + proc.stdout) if proc.returncode else ""


def text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def train_cli(run_dir: Path, target: Target, clock: Clock, *overrides: str) -> tuple[int, dict[str, Any], str]:
    """`train` as a user runs it: (exit code, summary.json or {}, what went wrong)."""
    cmd = [sys.executable, "-c", "from launcher.launch.cli import train; train()", f"run_dir={run_dir}", *QUIET]
    rc, why = run_logged([*cmd, *target.hardware, *overrides], run_dir / "train.out", clock)
    summary_file = run_dir / "summary.json"
    return rc, json.loads(summary_file.read_text()) if summary_file.exists() else {}, why


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def close(a: dict[int, float], b: dict[int, float], rtol: float) -> tuple[bool, float]:
    """Whether every common step's losses agree within `rtol`, and the worst relative difference."""
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in a.keys() & b.keys())
    return worst <= rtol, worst


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics(run_dir)}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
