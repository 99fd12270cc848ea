"""Mixture-of-experts figures on this CPU: `python -m bench moe [--quick] [--speed] [--rounds=N]` (--speed:
table 1 alone; --rounds: its rows N times, alternating their order, medians and each round's ratio, and
the ceiling of that ratio: ep=1's step over one process's, whose tokens and FLOPs every rank repeats).

1. Speed: moe_small on 2 workers (FSDP over dp=2) at ep=1 and ep=2, one after the other: tokens/s,
   MFU by active FLOPs (flops.py), and the planner's predicted step time beside the measured median;
   and one process's MFU. Every run is a real `train` (its own workers), so ratios are of runs
   under the same machine load, measured minutes apart. Every row resumes from one warm start
   (WARM_STEPS at gamma 0.01): a fresh moe_small routes ~80% of the tokens to one expert, and at ep=2
   that rank's experts set the pace; the planner predicts routing that bias balancing has evened out
   (`model.moe.rank_imbalance`, docs/planner.md), so the rows time steps where it has.
2. Balance: moe_small on the byte corpus for 100 steps (`+recipe=moe_balance_study`'s settings) with
   balance = bias, aux, none: moe_load_imbalance at step 100 and the validation loss at step 100.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

TRAIN = str(Path(sys.executable).parent / "train")
QUIET = ["metrics.console=none", "metrics.wandb.mode=disabled", "checkpoint.every=0", "threads=1"]
SHAPE = ["+model=moe_small", "seq_len=128", "batch.micro=8", "eval.every=0"]
# steps of gamma 0.01 before the timed ones: moe_load_imbalance ~1.5 from ~6 (a fresh model's)
WARM_STEPS = 80


def train(out: Path, name: str, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run_dir = out / name
    cmd = [TRAIN, *QUIET, f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "LAUNCHER_OUTPUTS": str(out)}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=out, env=env)
    if result.returncode:
        raise SystemExit(f"{name}: {result.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), rows


def warm_start(out: Path) -> Path:
    """One process, WARM_STEPS at gamma 0.01: the checkpoint every speed row resumes from."""
    train(
        out, "warm", *SHAPE, f"steps={WARM_STEPS}", "model.moe.bias_update_rate=0.01", f"checkpoint.every={WARM_STEPS}"
    )
    return out / "warm" / "checkpoints"


ROWS = (("one process", []), ("dp=2 ep=1", ["dp=2", "ep=1"]), ("dp=2 ep=2", ["dp=2", "ep=2"]))


def speed_row(out: Path, name: str, common: list[str], keys: list[str]) -> dict[str, float]:
    """One timed run of a row: tokens/s, MFU, median step, the planner's step, the median imbalance."""
    summary, rows = train(out, name, *common, *keys)
    timed = rows[1:]
    predicted = (summary.get("prediction") or {}).get("step_time_s")
    return {
        "tokens/s": summary["median_tokens_per_s"],
        "mfu": summary["median_mfu"],
        "step": statistics.median(r["step_time_s"] for r in timed),
        "predicted": predicted or float("nan"),
        # the busiest expert over the mean; the planner assumes the busiest ep rank's rows at 1.1 x the mean
        "imbalance": statistics.median(r["moe_load_imbalance"] for r in timed),
    }


def speed(out: Path, steps: int, rounds: int) -> None:
    """ROWS `rounds` times, in reverse order every other round (a drift in the machine's load hits
    both ep rows alike); each column the median over rounds, and each round's ep=2 / ep=1 ratio."""
    common = [*SHAPE, f"steps={WARM_STEPS + steps}", f"resume={warm_start(out)}"]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in ROWS}
    for r in range(rounds):
        for name, keys in ROWS if r % 2 == 0 else ROWS[::-1]:
            runs[name].append(speed_row(out, f"{name.replace(' ', '_').replace('=', '')}_{r}", common, keys))
    table = Table(title=f"moe_small: expert parallelism on 2 workers (median of {rounds} round(s))")
    cols = ("layout", "tokens/s", "MFU", "step s measured", "step s predicted", "predicted / measured", "imbalance")
    for col in cols:
        table.add_column(col, justify="right")
    for name, got in runs.items():
        med = {key: statistics.median(run[key] for run in got) for key in got[0]}
        ratio = med["predicted"] / med["step"]
        table.add_row(name, f"{med['tokens/s']:,.0f}", f"{med['mfu']:.2%}", f"{med['step']:.3f}",
                      f"{med['predicted']:.3f}", f"{ratio:.2f}", f"{med['imbalance']:.2f}")  # fmt: skip
    Console().print(table)
    ratios = [a["tokens/s"] / b["tokens/s"] for a, b in zip(runs["dp=2 ep=2"], runs["dp=2 ep=1"])]
    each = ", ".join(f"{x:.2f}" for x in ratios)
    print(f"ep=2 / ep=1 tokens/s on 2 workers: {statistics.median(ratios):.2f} (median; each round: {each})")
    # every rank steps the one process's tokens with the same FLOPs at ep=1 and ep=2: with no cost of
    # communication ep=2 would step as one process does (two such processes side by side keep their pace here)
    ceiling = statistics.median(b["step"] / a["step"] for a, b in zip(runs["one process"], runs["dp=2 ep=1"]))
    print(f"ceiling: ep=1's step / one process's, the same tokens per rank: {ceiling:.2f}")


def balance(out: Path, steps: int) -> None:
    common = ["+model=moe_small", f"steps={steps}", "seq_len=128", "batch.micro=8", f"eval.every={steps}"]
    common += ["eval.batches=8", "model.moe.bias_update_rate=0.01", "optim.warmup_steps=10"]
    table = Table(title=f"moe_small balancing, {steps} steps on the byte corpus")
    for col in ("balance", f"moe_load_imbalance @ {steps}", "mean over last 10", f"val loss @ {steps}", "train loss"):
        table.add_column(col, justify="right")
    for mode in ("bias", "aux", "none"):
        summary, rows = train(out, f"balance_{mode}", *common, f"model.moe.balance={mode}")
        last = [r["moe_load_imbalance"] for r in rows[-10:]]
        table.add_row(
            mode,
            f"{rows[-1]['moe_load_imbalance']:.3f}",
            f"{sum(last) / len(last):.3f}",
            f"{summary['val_loss']:.4f}",
            f"{summary['final_loss']:.4f}",
        )
    Console().print(table)


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    rounds = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--rounds=")), 1)
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        speed(Path(tmp), 6 if quick else 12, rounds)
        if "--speed" not in argv:  # the speed table alone
            balance(Path(tmp), 20 if quick else 100)
