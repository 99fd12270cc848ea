"""`python -m bench simulate_grid [--quick] [--only SUBSTRING]`: the planner's memory beside the simulation
(`simulate=true`, docs/simulate.md) over a grid of real layouts: per layout its busiest pipeline position,
each category simulated / predicted and the planner's error on the peak (the same columns as the
simulation's table; the overhead the tracker cannot see left out of both).

`--quick`: the layouts of `1b` and smaller, `8b` and `mixtral_8x7b` (a few minutes here); the whole grid adds
`70b` and `405b` (about ten minutes more on two cores).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

H100 = ("hardware=h100_sxm",)
GRID: dict[str, tuple[str, ...]] = {
    # one node of H100s: tensor, sequence, data and pipeline parallelism, each recompute policy
    "8b tp8": ("+model=8b", *H100, "nodes=1", "tp=8"),
    "8b tp8 sp": ("+model=8b", *H100, "nodes=1", "tp=8", "sequence_parallel=true"),
    "8b tp8 selective": ("+model=8b", *H100, "nodes=1", "tp=8", "recompute=selective"),
    "8b tp8 full": ("+model=8b", *H100, "nodes=1", "tp=8", "recompute=full"),
    "8b tp4 fsdp2": ("+model=8b", *H100, "nodes=1", "tp=4", "dp_shard=2"),
    "8b fsdp8": ("+model=8b", *H100, "nodes=1", "dp_shard=8"),
    "8b ddp2 tp4": ("+model=8b", *H100, "nodes=1", "tp=4", "dp=2", "dp_shard=1"),
    # context parallelism at 8k tokens; fp8 (torchao's float8 training: its fp8 weight and input casts)
    "8b tp4 cp2 8k": ("+model=8b", *H100, "nodes=1", "tp=4", "cp=2", "seq_len=8192"),
    "8b fsdp8 fp8": ("+model=8b", *H100, "nodes=1", "dp_shard=8", "dtype=fp8"),
    "8b tp8 fp8": ("+model=8b", *H100, "nodes=1", "tp=8", "dtype=fp8"),
    "8b tp2 pp4 1f1b": ("+model=8b", *H100, "nodes=1", "tp=2", "pp=4", "pp_schedule=1f1b"),
    "8b tp2 pp4 interleaved": (
        *("+model=8b", *H100, "nodes=1", "tp=2", "pp=4"),
        *("pp_schedule=interleaved_1f1b", "virtual_stages=2"),
    ),
    # eight nodes: the 70b layout and its neighbours
    "70b tp8 pp4 interleaved": (
        *("+model=70b", *H100, "nodes=8", "tp=8", "pp=4", "dp=2"),
        *("pp_schedule=interleaved_1f1b", "virtual_stages=2"),
    ),
    "70b tp8 pp8 1f1b": ("+model=70b", *H100, "nodes=8", "tp=8", "pp=8", "pp_schedule=1f1b"),
    "70b tp8 fsdp8": ("+model=70b", *H100, "nodes=8", "tp=8", "dp_shard=8"),
    "70b tp8 pp2 hsdp2x2": ("+model=70b", *H100, "nodes=8", "tp=8", "pp=2", "dp_replicate=2", "dp_shard=2"),
    "70b tp8 pp4 dp2 full": ("+model=70b", *H100, "nodes=8", "tp=8", "pp=4", "dp=2", "recompute=full"),
    "70b tp8 cp2 pp4 8k": ("+model=70b", *H100, "nodes=8", "tp=8", "cp=2", "pp=4", "seq_len=8192", "batch.micro=1"),
    "405b tp8 pp16": ("+model=405b", *H100, "nodes=2048", "tp=8", "pp=16"),
    # a mixture of experts (routing balanced): expert parallelism over 8 ranks, its experts FSDP-sharded over 2
    "mixtral ep8": ("+model=mixtral_8x7b", *H100, "nodes=2", "ep=8"),
    "mixtral ep8 tp2 pp2": ("+model=mixtral_8x7b", *H100, "nodes=4", "ep=8", "tp=2", "pp=2"),
    # layouts this CPU also runs for real (their measured peaks: bench memory)
    "1b tp2": ("+model=1b", "tp=2"),
    "1b pp2": ("+model=1b", "pp=2"),
    "1b fsdp2": ("+model=1b", "dp=2", "dp_shard=2"),
    "small tp2 sp": ("+model=small", "tp=2", "sequence_parallel=true"),
    "small pp2 gpipe": ("+model=small", "pp=2", "pp_schedule=gpipe"),
    "small tp2 selective": ("+model=small", "tp=2", "recompute=selective"),
    "tiny ddp2": ("+model=tiny", "dp=2", "dp_shard=1"),
}
QUICK = [name for name in GRID if not name.startswith(("70b", "405b"))]
COLUMNS = ("params", "grads", "optimizer", "working", "peak")


def simulate_layout(overrides: tuple[str, ...]) -> dict[str, Any]:
    """`train OVERRIDES simulate=true`, in this process, quietly: the simulation's JSON."""
    from dataclasses import replace

    from launcher.config.schema import compose_config
    from launcher.launch.cli import run_of
    from launcher.planner import resolve
    from launcher.planner.request import problem
    from launcher.simulate import simulate

    cfg = compose_config(*overrides, "simulate=true")
    layout, prediction, options = resolve(replace(cfg, force=True), None)
    run = run_of(cfg, layout, prediction, options)
    return simulate(run, problem(cfg, layout.world_size), out=lambda _: None)


def busiest(result: dict[str, Any]) -> dict[str, Any]:
    """The position whose simulated peak is the largest."""
    return max(result["ranks"], key=lambda r: r["simulated_gib"]["peak"])


def error(sim: float, plan: float) -> str:
    return f"{(plan - sim) / sim:+.0%}" if sim > 1e-3 else "-"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench simulate_grid")
    parser.add_argument("--quick", action="store_true", help="1b and smaller, and 8b")
    parser.add_argument("--only", default="", help="the layouts whose name holds this")
    args = parser.parse_args(argv)
    names = [n for n in (QUICK if args.quick else GRID) if args.only in n]
    head = f"{'layout':<27} {'pp':>2} " + " ".join(f"{c:>13}" for c in COLUMNS) + "  error  time"
    print("GiB per rank at the busiest position, simulated / predicted; error: the planner's on the peak")
    print(head)
    print("-" * len(head))
    for name in names:
        t0 = time.perf_counter()
        row = busiest(simulate_layout(GRID[name]))
        sim, plan = row["simulated_gib"], row["predicted_gib"]
        cells = " ".join(f"{sim[c]:>6.2f}/{plan[c]:<6.2f}" for c in COLUMNS)
        took = time.perf_counter() - t0
        print(f"{name:<27} {row['pp']:>2} {cells} {error(sim['peak'], plan['peak']):>6} {took:>4.0f} s", flush=True)
