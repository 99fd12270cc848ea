"""Issue 5 figures: checkpoint save/load time and size (small and ~125M models), and what saving
every N steps costs in training throughput, synchronous against asynchronous saving."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from launcher.config.schema import compose_config as make_config
from launcher.launch.cli import run_of
from launcher.model.init import initialized_model
from launcher.planner import resolve
from launcher.train.checkpoint import Checkpointer, Stateful
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.loop import train
from launcher.train.optim import build_optimizer


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def save_load(model_name: str, tmp: Path) -> tuple[float, float, float]:
    cfg = make_config(f"+model={model_name}", "checkpoint.every=1")
    model = initialized_model(cfg.model, cfg.seed, torch.device("cpu"))
    optimizer, _ = build_optimizer([model], cfg.optim, 10)
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    optimizer.step()  # Adam moments exist, as in a real checkpoint
    ckpt = Checkpointer(cfg.checkpoint, tmp / model_name, 0)
    t0 = time.perf_counter()
    ckpt.save([model], optimizer, Stateful(1, {"loader": {}, "schedule": {}}))
    saved = time.perf_counter() - t0
    path = complete_checkpoints(tmp / model_name)[0]
    t0 = time.perf_counter()
    ckpt.load([path], [model], optimizer)
    loaded = time.perf_counter() - t0
    size = size_mib(path)
    shutil.rmtree(tmp / model_name)
    return saved, loaded, size


def throughput(tmp: Path, name: str, *overrides: str) -> float:
    """Effective tokens/s over a run, save time included (timestamps of the first and last step)."""
    cfg = make_config(
        "+model=small",
        "steps=41",
        "seq_len=128",
        "eval.every=0",
        "metrics.console=none",
        "metrics.wandb.mode=disabled",
        *overrides,
    )
    train(run_of(cfg, *resolve(cfg)), tmp / name)
    rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    tokens = (len(rows) - 1) * cfg.batch["micro"] * cfg.seq_len
    return tokens / (rows[-1]["time"] - rows[0]["time"])


def main(argv: list[str]) -> None:
    console = Console()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        table = Table(title="checkpoint save/load (model + AdamW state, fp32, one process)")
        for col in ("model", "size MiB", "save s", "load s", "save MiB/s"):
            table.add_column(col, justify="right")
        for model in ("small", "125m"):
            saved, loaded, size = save_load(model, tmp)
            table.add_row(model, f"{size:,.0f}", f"{saved:.2f}", f"{loaded:.2f}", f"{size / saved:,.0f}")
        console.print(table)
        table = Table(title="throughput with checkpoints every 10 steps (small model, 40 steps, 3 alternating rounds)")
        for col in ("saving", "tokens/s (median)", "vs none"):
            table.add_column(col, justify="right")
        modes = {
            "none": ("checkpoint.every=0",),
            "sync": ("checkpoint.every=10", "checkpoint.async_save=false"),
            "async": ("checkpoint.every=10", "checkpoint.async_save=true"),
        }
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for i in range(3):
            for mode, overrides in modes.items():
                rates[mode].append(throughput(tmp, f"{mode}{i}", *overrides))
        base = statistics.median(rates["none"])
        for mode in modes:
            rate = statistics.median(rates[mode])
            table.add_row(mode, f"{rate:,.0f}", f"{rate / base:.3f}")
        console.print(table)
