"""Issue 2 figures: launcher overhead against a bare loop, time to the first step, CPU MFU.

Both sides run as fresh processes with the same model (`small`), data, batch, per-step work (see
bench/bare_loop.py) and threads (`threads=` and the OpenMP/MKL variables alike), in alternating
order from round to round so machine noise hits both alike. Each side's figure is one statistic of
the wall-clock times between consecutive step ends, after WARMUP steps: the launcher's span includes
everything its loop does per step (metrics, sinks, guard, checkpoint and preemption checks), not
only the part its step timer covers. The statistic is the 10th percentile of those spans, not their
median: on a shared machine (2 cores, other processes at a load of 5) the cores are taken for most
of a run, and contention only ever lengthens a step, so the quickest steps measure the code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.fresh import timed_train
from launcher.hardware.probes import measure_gemm_flops, offer_gemm_peak

TRAIN = str(Path(sys.executable).parent / "train")
STEPS, WARMUP, MICRO, SEQ = 50, 5, 8, 256


def steady_rate(step_ends: list[float]) -> float:
    """Tokens/s at the 10th percentile of step spans after WARMUP, a span from one step's end to the next's."""
    spans = [b - a for a, b in zip(step_ends[WARMUP:], step_ends[WARMUP + 1 :])]
    return MICRO * SEQ / statistics.quantiles(spans, n=10)[0]


def pinned_env(threads: int, **extra: str) -> dict[str, str]:
    """The environment of either side: the same thread counts for every library that reads one."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}


def launcher_run(tmp: Path, threads: int, cache: str, i: int) -> tuple[float, float, float]:
    """(steady tokens/s, MFU at that rate, seconds from process start to the first finished step)."""
    run_dir = tmp / f"run{i}"
    args = [
        TRAIN,
        f"steps={STEPS}",
        f"batch.micro={MICRO}",
        f"seq_len={SEQ}",
        f"threads={threads}",
        "eval.every=0",
        "metrics.console=none",
        "metrics.wandb.mode=disabled",
        f"data.cache_dir={cache}",
        f"cache_dir={cache}",  # the GEMM peak too: this bench raises it when it measures a higher one
        f"run_dir={run_dir}",
    ]
    summary, first = timed_train(args, tmp, pinned_env(threads, LAUNCHER_OUTPUTS=str(tmp)), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rate = steady_rate([row["time"] for row in rows])
    return rate, rate * summary["flops_per_token"] / summary["peak_flops_per_device"], first


def bare_run(threads: int, cache: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "bench.bare_loop", str(STEPS), str(MICRO), str(SEQ), str(threads), cache],
        capture_output=True,
        text=True,
        check=True,
        env=pinned_env(threads),
    )
    return steady_rate(json.loads(out.stdout.strip().splitlines()[-1])["step_ends"])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench overhead")
    parser.add_argument("--rounds", type=int, default=5, help="alternating launcher/bare rounds")
    rounds = parser.parse_args(argv).rounds
    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache = str(tmp / "cache")
        launcher_run(tmp, threads, cache, -1)  # warm caches: corpus, GEMM calibration
        raised = offer_gemm_peak(threads, cache, measure_gemm_flops(threads))  # a peak is a maximum
        if raised:
            print(raised)
        launcher, bare, mfus, firsts = [], [], [], []

        def launcher_side(i: int) -> None:
            rate, mfu, first = launcher_run(tmp, threads, cache, i)
            launcher.append(rate)
            mfus.append(mfu)
            firsts.append(first)

        def bare_side(i: int) -> None:
            bare.append(bare_run(threads, cache))

        for i in range(rounds):
            for side in (launcher_side, bare_side)[:: 1 if i % 2 == 0 else -1]:  # alternate who goes first
                side(i)
    ratio = statistics.median(launcher) / statistics.median(bare)
    per_round = [t / b for t, b in zip(launcher, bare)]
    table = Table(title=f"launcher overhead: small model, batch {MICRO}x{SEQ}, {threads} threads, {rounds} rounds")
    for col in ("figure", "value"):
        table.add_column(col)
    table.add_row("train tokens/s (median of rounds)", f"{statistics.median(launcher):,.0f}")
    table.add_row("bare loop tokens/s (median of rounds)", f"{statistics.median(bare):,.0f}")
    table.add_row("ratio train / bare (goal ≥ 0.98)", f"{ratio:.3f}")
    table.add_row(
        "per-round ratios: median, spread",
        f"{statistics.median(per_round):.3f}, {min(per_round):.3f}-{max(per_round):.3f}",
    )
    table.add_row("time to first step, warm cache (s)", f"{statistics.median(firsts):.2f}")
    table.add_row("CPU MFU of `small` (vs measured GEMM peak)", f"{statistics.median(mfus):.1%}")
    Console().print(table)
