"""Issue 15: the peer comparison's exact shape, this code against the commit before the speed work.

Model: dim 256, 6 layers, 16 heads (16 KV heads), SwiGLU 768, vocabulary 2048, untied embeddings,
RMSNorm (6,163,712 parameters); seq_len 2048, local batch 8 (one micro-batch), no recompute, fp32.
Layouts: one process, tp=2, FSDP dp_shard=2. Each run is a fresh `train` process; the baseline runs
from a `git worktree` of `BASELINE` made in a temporary folder (same venv, its own code on
PYTHONPATH), and the two alternate, layout by layout, round by round, so the machine's noise hits
both alike. Prints median tokens/s per layout and side, and the ratio of the medians.
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

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "1ad153d"  # main before issue 15's work
SHAPE = [
    "model.dim=256",
    "model.n_layers=6",
    "model.n_heads=16",
    "model.n_kv_heads=16",
    "model.ffn_dim=768",
    "model.vocab_size=2048",
    "model.tied_embeddings=false",
    "model.norm=rmsnorm",
    "model.max_seq_len=2048",
    "seq_len=2048",
    "recompute=none",
    "dtype=fp32",
]
LAYOUTS = {"1 process": ["batch.micro=8", "batch.global=8"], "tp=2": ["tp=2", "batch.micro=8", "batch.global=8"]}
LAYOUTS["fsdp dp_shard=2"] = ["dp=2", "batch.micro=8", "batch.global=16"]
ENTRY = "import sys; from launcher.cli import train; sys.argv[0] = 'train'; train()"


def run(code: Path, layout: list[str], steps: int, tmp: Path, tag: str) -> float:
    """Median tokens/s (steps after the first) of one fresh `train` process running `code`."""
    run_dir = tmp / tag
    args = [*SHAPE, *layout, f"steps={steps}", "eval.every=0", "metrics.console=none", "metrics.wandb.mode=disabled"]
    args += ["checkpoint.every=0", f"run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(code), "LAUNCHER_OUTPUTS": str(tmp)}
    done = subprocess.run([sys.executable, "-c", ENTRY, *args], cwd=code, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tag} failed ({done.returncode}): {done.stderr.strip().splitlines()[-3:]}")
    return json.loads((run_dir / "summary.json").read_text())["median_tokens_per_s"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench peer_shape")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (fresh processes each)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    parser.add_argument("--baseline", default=BASELINE, help="commit to compare against")
    opts = parser.parse_args(argv)
    rates: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), opts.baseline], cwd=ROOT, check=True)
        try:
            for r in range(opts.rounds):
                for name, layout in LAYOUTS.items():
                    for side, code in (("current", ROOT), ("baseline", base)):
                        tag = f"{side}-{name.split()[0]}-{r}"
                        rates.setdefault((name, side), []).append(run(code, layout, opts.steps, tmp, tag))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    table = Table(title=f"peer shape, fp32, {opts.rounds} alternating rounds vs {opts.baseline} (tokens/s)")
    for col in ("layout", "current (median)", "baseline (median)", "ratio", "ratios per round"):
        table.add_column(col)
    for name in LAYOUTS:
        cur, old = rates[(name, "current")], rates[(name, "baseline")]
        per_round = " ".join(f"{c / o:.2f}" for c, o in zip(cur, old))
        ratio = statistics.median(cur) / statistics.median(old)
        table.add_row(
            name, f"{statistics.median(cur):,.0f}", f"{statistics.median(old):,.0f}", f"{ratio:.3f}", per_round
        )
    Console().print(table)
