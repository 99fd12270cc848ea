"""`python -m bench plan_speed [--repeats 3]`: how long `plan` searches the largest space it is given,
405b on 16,384 devices (16M-token batch, tp/pp/schedule/recompute/micro auto, explore), per hardware.
CPU time of this process, the best of `repeats` (the search is single-threaded Python: other
processes' load, which wall time counts, does not move it). The budget: under a second (docs/planner.md).
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from bench.published_runs import make_cfg
from launcher import planner
from launcher.planner.search import Result

BUDGET_S = 1.0
DEVICES = 16384
HARDWARE = (("h100_sxm", 8), ("gb200_nvl72", 4), ("tpu_v5p", 4))  # profile, devices per node


def search_405b(hardware: str, per_node: int) -> Result:
    batch = {"micro": "auto", "global": 2048}
    auto = dict(tp="auto", pp="auto", pp_schedule="auto", recompute="auto")
    cfg = make_cfg("405b", hardware, nodes=DEVICES // per_node, seq_len=8192, batch=batch, **auto)
    return planner.plan(cfg, DEVICES, explore=True)[1]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench plan_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    table = Table(title=f"plan: 405b on {DEVICES:,} devices, CPU seconds (best of {args.repeats})")
    for col in ("hardware", "layouts tried", "fit", "seconds", f"< {BUDGET_S:.0f} s"):
        table.add_column(col, justify="left" if col == "hardware" else "right")
    for hardware, per_node in HARDWARE:
        search_405b(hardware, per_node)  # warm: imports, memoised counts
        times = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            res = search_405b(hardware, per_node)
            times.append(time.process_time() - t0)
        best = min(times)
        table.add_row(hardware, str(res.tried), str(len(res.ranked)), f"{best:.3f}", "yes" if best < BUDGET_S else "no")
    Console(width=120).print(table)
