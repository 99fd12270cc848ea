"""Issue 15: the peer comparison's exact shape, this code against the commit before the speed work.

Model: dim 256, 6 layers, 16 heads (16 KV heads), SwiGLU 768, vocabulary 2048, untied embeddings,
RMSNorm (6,163,712 parameters); seq_len 2048, local batch 8 (one micro-batch), no recompute, fp32.
Layouts: one process, tp=2, FSDP dp_shard=2. Each run is a fresh `train` process; the baseline runs
from a `git worktree` of `BASELINE` made in a temporary folder (same venv, its own code on
PYTHONPATH), and the two alternate, layout by layout, round by round, so the machine's noise hits
both alike. Prints median tokens/s per layout and side, the ratio of the medians, the ratio of each
side's fastest step over all rounds (on a busy host the steadier figure: contention only lengthens
a step), and the seconds from process start to the first step. `--compile`: this code with compiled blocks against eager
(inductor's CPU backend needs a C++ compiler, g++ here, and compiles in worker processes).
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
ENTRY = "import sys; from launcher.launch.cli import train; sys.argv[0] = 'train'; train()"


def run(code: Path, layout: list[str], steps: int, tmp: Path, tag: str) -> tuple[float, float, float, float]:
    """(median tokens/s of the steps after the first, seconds from process start to the first step's
    metrics, the largest rank's peak resident set in GiB, tokens/s of the fastest step after the
    first: sharing the machine only lengthens steps) of one fresh `train` process running `code`."""
    run_dir = tmp / tag
    args = [*SHAPE, *layout, f"steps={steps}", "eval.every=0", "metrics.console=none", "metrics.wandb.mode=disabled"]
    # each side its own calibration cache: the baseline cannot read the current code's GEMM peak records
    args += ["checkpoint.every=0", f"run_dir={run_dir}", f"cache_dir={tmp / 'cache' / code.name}"]
    env = {**os.environ, "PYTHONPATH": str(code), "LAUNCHER_OUTPUTS": str(tmp)}
    summary, first = timed_train([sys.executable, "-c", ENTRY, *args], code, env, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    best = max(row["tokens_per_s"] for row in rows[1:] or rows if "tokens_per_s" in row)
    return summary["median_tokens_per_s"], first, summary["peak_mem_gib"], best


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench peer_shape")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (fresh processes each)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    parser.add_argument("--baseline", default=BASELINE, help="commit to compare against")
    parser.add_argument("--compile", action="store_true", help="compare compile=true against eager instead")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of the layouts")
    opts = parser.parse_args(argv)
    layouts = {name: LAYOUTS[name] for name in opts.layouts.split(",")}
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "baseline"
        if opts.compile:  # both sides this code: compiled blocks against eager ones
            sides = {"compile": (ROOT, ["compile=true"]), "eager": (ROOT, ["compile=false"])}
        else:
            subprocess.run(["git", "worktree", "add", "--detach", str(base), opts.baseline], cwd=ROOT, check=True)
            sides = {"current": (ROOT, []), "baseline": (base, [])}
        try:
            for r in range(opts.rounds):
                for i, (name, layout) in enumerate(layouts.items()):
                    for side, (code, extra) in sides.items():
                        tag = f"{side}-{i}-{r}"  # no "=" in a path Hydra reads
                        results.setdefault((name, side), []).append(run(code, layout + extra, opts.steps, tmp, tag))
        finally:
            if base.exists():
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    new, old = sides
    what = "compile=true vs eager" if opts.compile else f"this code vs {opts.baseline}"
    table = Table(title=f"peer shape, fp32, {opts.rounds} alternating rounds, {what} (tokens/s)")
    heads = ("layout", f"{new} (median)", f"{old} (median)", "ratio", "per round", "fastest steps' ratio")
    heads = (*heads, "first step s (new, old)")
    for col in (*heads, "peak RSS GiB (new, old)"):
        table.add_column(col)
    for name in layouts:
        cur, ref = results[(name, new)], results[(name, old)]
        per_round = " ".join(f"{c[0] / o[0]:.2f}" for c, o in zip(cur, ref))
        rate_new, rate_old = (statistics.median(x[0] for x in side) for side in (cur, ref))
        first = ", ".join(f"{statistics.median(x[1] for x in side):.0f}" for side in (cur, ref))
        rss = ", ".join(f"{statistics.median(x[2] for x in side):.3f}" for side in (cur, ref))
        fastest = max(x[3] for x in cur) / max(x[3] for x in ref)
        ratio = f"{rate_new / rate_old:.3f}"
        table.add_row(name, f"{rate_new:,.0f}", f"{rate_old:,.0f}", ratio, per_round, f"{fastest:.3f}", first, rss)
    Console().print(table)
