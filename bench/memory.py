"""Issue 14 figures: measured peak memory per rank (peak RSS of each worker) of real builds and runs,
against the full model's fp32 bytes and the planner's prediction, and the time to build.

- `1b` with `steps=0` (built for real): tp=4, and tp=2 x pp=2 (untied embeddings: tied ones cannot
  cross pipeline stages). Goals: ≤ model / world + its largest parameter + 0.5 GiB per rank, and
  within ±15% of the planner's memory for what a build holds (no gradients, activations or optimizer
  states yet). And tp=4 with `smoke=true` (one forward/backward on one microbatch; no optimizer step:
  a full AdamW step of 1b on 4 CPU workers needs ~20 GiB): its time is build-to-first-step.
- `125m`, 3 training steps, 4 layouts: peak per rank against the planner's prediction (±15%), with
  `cpu_allocator=lean` (what `steps=0` uses) so that peak RSS is the run's, not glibc's cache.
Every run is a fresh `train` process tree; the figures are noisy on a shared machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from launcher import flops
from launcher.config.schema import compose_config
from launcher.flops import GIB

TRAIN = str(Path(sys.executable).parent / "train")
QUIET = ["eval.every=0", "checkpoint.every=0", "metrics.console=none", "metrics.wandb.mode=disabled"]
BUILDS = {  # steps=0, and with smoke=true
    "1b tp=4": ["+model=1b", "tp=4", "steps=0"],
    "1b tp=2 pp=2": ["+model=1b", "tp=2", "pp=2", "model.tied_embeddings=false", "steps=0"],
    "1b tp=4 smoke": ["+model=1b", "tp=4", "steps=0", "smoke=true"],
}
NOT_YET = {False: ("optimizer", "grads", "activations", "logits"), True: ("optimizer",)}  # a build does not hold
RUNS = {  # 3 training steps of 125m
    "125m 1 process": ["+model=125m"],
    "125m tp=2": ["+model=125m", "tp=2"],
    "125m dp=2 (FSDP)": ["+model=125m", "dp=2"],
    "125m pp=2": ["+model=125m", "pp=2", "model.tied_embeddings=false"],
}


def train(args: list[str], tmp: Path, name: str, cache: str) -> dict[str, Any]:
    run_dir = tmp / re.sub(r"\W+", "_", name)
    data = [f"data.cache_dir={cache}", "data.max_bytes=2000000", "seq_len=128", "batch.micro=1"]
    cmd = [TRAIN, *args, *data, *QUIET, f"run_dir={run_dir}"]
    env = {**os.environ, "LAUNCHER_OUTPUTS": str(tmp)}
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def model_bytes(args: list[str]) -> tuple[int, int]:
    """(the whole model's fp32 bytes, its largest parameter's), from the shapes alone."""
    from launcher.model.init import meta_model

    params = list(meta_model(compose_config(*args).model).parameters())
    return sum(p.numel() for p in params) * 4, max(p.numel() for p in params) * 4


def ranks_text(per_rank: list[float]) -> str:
    return " ".join(f"{g:.2f}" for g in per_rank)


def main(argv: list[str]) -> None:
    console = Console(width=200)
    cache = os.environ.get("LAUNCHER_BENCH_CACHE", str(Path.home() / ".cache" / "launcher"))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        table = Table(title="steps=0: peak RSS per rank (GiB) against the model and the planner")
        columns = ("build", "per rank", "model/world + largest + 0.5", "predicted (as built)", "build s", "then s")
        for col in columns:
            table.add_column(col, justify="right")
        for name, args in BUILDS.items():
            s = train(args, tmp, name, cache)
            total, largest = model_bytes(args)
            bound = (total / s["world_size"] + largest) / GIB + 0.5
            mem = s["prediction"]["memory"]
            predicted = mem["total"] - sum(mem[k] for k in NOT_YET["smoke=true" in args])
            worst = s["peak_mem_gib"]
            table.add_row(
                name,
                ranks_text(s["peak_mem_gib_per_rank"]),
                f"{bound:.2f} ({'ok' if worst <= bound else 'over'})",
                f"{predicted:.2f} ({worst / predicted - 1:+.0%})",
                f"{s['build_time_s']:.1f}",
                f"{s['wall_time_s'] - s['build_time_s']:.1f}",
            )
        console.print(table)
        console.print(f"(1b: {flops.num_params(compose_config('+model=1b').model) / 1e9:.2f} B parameters)")
        table = Table(title="125m, 3 steps: peak RSS per rank (GiB) against the planner")
        for col in ("run", "per rank", "predicted", "worst vs predicted"):
            table.add_column(col, justify="right")
        for name, args in RUNS.items():
            s = train([*args, "steps=3", "cpu_allocator=lean"], tmp, name, cache)
            predicted = s["prediction"]["memory_gib"]
            table.add_row(
                name,
                ranks_text(s["peak_mem_gib_per_rank"]),
                f"{predicted:.2f}",
                f"{s['peak_mem_gib'] / predicted - 1:+.0%}",
            )
        console.print(table)
