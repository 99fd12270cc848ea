"""Pipeline schedules on this CPU, planner against runtime: `python -m bench schedules [--steps 6]`.

For each schedule at pp=2 (the `small` model, fp32, global batch 8 x 256 in 4 microbatches of 2,
one 2-rank launch running them one after another): per pipeline rank, the peak bytes autograd holds
saved for the rank's blocks over one step (saved-tensor hooks around every block's forward,
parameters and the RoPE table excluded, each storage once, freed when the graph lets go of it)
against the planner's activations for that rank (`rank_memory`: one layer's bytes x layers x
microbatches in flight), which must be equal; and the median step time (slowest rank) against the
planner's `step_time_s`. Timing on 2 shared cores is noisy: read the ratios of one run side by side.
Then each schedule's timeline at pp=2 and pp=4, as the docs show it (`timeline_text`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.parallel import SavedTensorMeter, train_step
from bench.planner_accuracy import TOLERANCE
from launcher.config.layout_keys import from_config
from launcher.config.schema import TrainConfig, compose_config
from launcher.layout import build_mesh, worker_threads
from launcher.parallel import build_runner
from launcher.planner import build_options, resolve
from launcher.planner.memory import rank_memory
from launcher.train.optim import build_optimizer

CASES = {  # name: overrides (pp=2)
    "1f1b": ("pp_schedule=1f1b",),
    "interleaved_1f1b": ("pp_schedule=interleaved_1f1b", "virtual_stages=2"),
    "interleaved_zb v1": ("pp_schedule=interleaved_zb",),
    "interleaved_zb v2": ("pp_schedule=interleaved_zb", "virtual_stages=2"),
    "zbv": ("pp_schedule=zbv",),
    "dualpipev": ("pp_schedule=dualpipev",),
}
SEQ, BATCH, MICRO = 256, 8, 2


def case_config(name: str) -> TrainConfig:
    return compose_config(
        "+model=small", "hardware=cpu", "pp=2", f"seq_len={SEQ}", f"batch.global={BATCH}", f"batch.micro={MICRO}",
        *CASES[name],
    )  # fmt: skip


def meter_blocks(parts: list[torch.nn.Module], meter: SavedTensorMeter) -> list[Any]:
    """Count what the blocks save: the meter's hooks are on only inside each block's forward."""

    def enter(*_: Any) -> None:
        meter.__enter__()

    def leave(*_: Any) -> None:
        meter.__exit__(None, None, None)

    handles = []
    for part in parts:
        for block in part.layers.values():
            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    return handles


def worker(rank: int, world: int, names: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Every schedule built side by side; peak saved block activations of one step each, then
    `steps` rounds timing one step of each in turn (the machine's load shifts alike for all)."""
    torch.set_num_threads(worker_threads(None, world))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen) for _ in range(steps + 2)]
    built, out = {}, {}
    for name in names:
        cfg = case_config(name)
        layout = from_config(cfg, world)
        runner = build_runner(cfg.model, layout, build_mesh(layout), build_options(cfg, layout), torch.device("cpu"))
        optimizer, _ = build_optimizer(runner.parts, cfg.optim, 100)
        train_step(runner, optimizer, batches[0])  # warm-up: shapes, buffers
        exclude = {p.untyped_storage().data_ptr() for part in runner.parts for p in part.parameters()}
        exclude |= {part.rope.untyped_storage().data_ptr() for part in runner.parts if part.rope is not None}
        meter = SavedTensorMeter(exclude)
        handles = meter_blocks(runner.parts, meter)
        train_step(runner, optimizer, batches[1])
        for h in handles:
            h.remove()
        built[name] = (runner, optimizer)
        out[name] = {"peak": meter.peak, "leftover": meter.live, "times": []}
    for tokens in batches[2:]:
        for name, (runner, optimizer) in built.items():
            t0 = time.perf_counter()
            train_step(runner, optimizer, tokens)
            out[name]["times"].append(time.perf_counter() - t0)
    for r in out.values():
        times = r.pop("times")
        r["time"] = statistics.median(times) if times else float("nan")
    return out


def rows(steps: int) -> list[dict[str, Any]]:
    from tests.dist import run

    per_rank = run(worker, 2, list(CASES), steps, timeout=1800)
    out = []
    for name in CASES:
        cfg = case_config(name)
        layout, prediction, _ = resolve(cfg, 2)
        predicted = [rank_memory(cfg.model, SEQ, layout, 4, "cpu", r).activations for r in range(2)]
        measured = [r[name]["peak"] for r in per_rank]
        step = max(r[name]["time"] for r in per_rank)
        ts = prediction.time.as_dict()
        out.append(
            {"name": name, "predicted": predicted, "measured": measured, "step_pred": ts["total"], "step": step,
             "bubble": ts["pp_bubble"], "leftover": [r[name]["leftover"] for r in per_rank]}
        )  # fmt: skip
    return out


def timeline_text(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2) -> str:
    """The schedule's timeline as the docs show it: torch's action order for each rank, timed by the
    planner's timeline (forward = input gradient = weight gradient = 1 cell, full backward 2)."""
    from launcher.compat.pipeline_compat import schedule_actions
    from launcher.layout import Layout
    from launcher.parallel.pipeline import schedule_class
    from launcher.planner.timeline import render, simulate

    lay = Layout(pp=pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages)
    orders = schedule_actions(schedule_class(schedule), pp, [lay.pp_stages(r) for r in range(pp)], microbatches)
    return render(simulate(orders))


def main(argv: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="python -m bench schedules", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per schedule (median)")
    args = parser.parse_args(argv)
    console = Console() if Console().is_terminal else Console(width=160)
    table = Table(title=f"pipeline schedules, planner vs runtime: small, fp32, pp=2, {BATCH} x {SEQ} in 4 microbatches")
    for col in ("schedule", "rank 0 acts MiB pred/meas", "rank 1 acts MiB pred/meas", "equal",
                "step s pred", "step s meas", "pred/meas", "±25%", "vs 1f1b pred", "vs 1f1b meas"):  # fmt: skip
        table.add_column(col, justify="right")
    results = rows(args.steps)
    base = results[0]  # 1f1b
    for r in results:
        acts = [f"{p / 2**20:.2f} / {m / 2**20:.2f}" for p, m in zip(r["predicted"], r["measured"])]
        ratio = r["step_pred"] / r["step"]
        table.add_row(
            r["name"], *acts, "yes" if r["predicted"] == r["measured"] else "[red]no[/]", f"{r['step_pred']:.3f}",
            f"{r['step']:.3f}", f"{ratio:.2f}", "yes" if abs(ratio - 1) <= TOLERANCE else "[red]no[/]",
            f"{r['step_pred'] / base['step_pred']:.2f}", f"{r['step'] / base['step']:.2f}",
        )  # fmt: skip
    console.print(table)
    for schedule in ("interleaved_zb", "zbv", "dualpipev"):
        console.print(f"\n{schedule}, pp=4, 8 microbatches:\n{timeline_text(schedule, 4, 8)}")
