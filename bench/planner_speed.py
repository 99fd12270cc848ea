"""`python -m bench planner_speed [--repeats 5]`: how long `plan` takes for 405b on 16,384 devices, end to
end and by part. The budget: the command as a user runs it under half a second (docs/planner.md).

1. End to end: `plan +model=405b hardware=h100_sxm nodes=2048` in a fresh process (the console script
   of this environment), wall seconds and the child's CPU seconds, the median of `repeats` runs. Wall
   time counts other processes' load; CPU time does not.
2. The breakdown, each part timed in this process with time.perf_counter (CPU seconds beside it): the
   bare interpreter and the CLI's imports (fresh processes); the floor under any `plan` that composes
   its config with Hydra (FLOOR: a fresh process that imports the schema, composes COMMAND once;
   nothing of the planner); Hydra's compose, validate, building the
   problem and the search space, the search as `plan` runs it (plan.top: the best 10 predicted, the rest
   counted; of which enumerating the candidates, and the memory, bound and prediction calls, timed in a
   separate instrumented run), the search ranking every layout (plan.top=0, memoised terms warm),
   rendering the table and the JSON.
3. The largest space the planner is given (`search_405b`: 16M-token batch, seq_len 8192, tp, pp,
   schedule, recompute and micro auto, explore, the best TOP ranked) on three hardware profiles, the best
   of `repeats`.
"""

from __future__ import annotations

import argparse
import io
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

BUDGET_S = 0.5
TOP = 10  # plan.top's default: the best 10 ranked, the rest counted
DEVICES = 16384
COMMAND = ("+model=405b", "hardware=h100_sxm", f"nodes={DEVICES // 8}")
HARDWARE = (("h100_sxm", 8), ("gb200_nvl72", 4), ("tpu_v5p", 4))  # profile, devices per node
BIN = Path(sys.executable).parent
FLOOR = f"from launcher.config.schema import compose_config; compose_config(*{COMMAND!r}, config_name='plan')"


def search_405b(hardware: str, per_node: int, top: int = 0) -> Any:
    from bench.published_runs import make_cfg
    from launcher import planner

    batch = {"micro": "auto", "global": 2048}
    auto = dict(tp="auto", pp="auto", pp_schedule="auto", recompute="auto")
    cfg = make_cfg("405b", hardware, nodes=DEVICES // per_node, seq_len=8192, batch=batch, **auto)
    return planner.plan(cfg, DEVICES, explore=True, top=top)[1]


def fresh(argv: list[str], repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of `argv` run in a fresh process, its output discarded."""
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def timed(parts: dict[str, tuple[float, float]], name: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`, adding its wall and CPU seconds to parts[name]."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = parts.get(name, (0.0, 0.0))
    parts[name] = (wall + time.perf_counter() - w0, cpu + time.process_time() - c0)
    return out


def breakdown(repeats: int) -> dict[str, tuple[float, float]]:
    """Each part of `plan COMMAND` (the module docstring), the CLI's imports from fresh processes."""
    parts = {"interpreter": fresh([sys.executable, "-c", "pass"], repeats)}
    cli = fresh([sys.executable, "-c", "import launcher.launch.cli"], repeats)
    parts["imports (launcher.launch.cli)"] = (cli[0] - parts["interpreter"][0], cli[1] - parts["interpreter"][1])
    parts["floor: Hydra compose, fresh process"] = fresh([sys.executable, "-c", FLOOR], repeats)
    from launcher.config.layout_keys import plan_world_size
    from launcher.config.schema import compose_config
    from launcher.config.validate import validate
    from launcher.planner import report, request

    search = sys.modules["launcher.planner.search"]  # the module: `launcher.planner.search` names the function
    cfg = timed(parts, "compose (Hydra)", lambda: compose_config(*COMMAND, config_name="plan"))
    world = timed(parts, "validate", lambda: (validate(cfg), plan_world_size(cfg))[1])
    build = (request.problem, lambda c, w: request.space(c, w, True))
    prob, space = timed(parts, "problem and space", lambda: [make(cfg, world) for make in build])
    res = timed(parts, "search (plan.top: the rest counted)", lambda: search.search(prob, space, cfg.plan.top))
    timed(parts, "  enumeration", lambda: list(search.candidates(prob, space)))
    instrumented: dict[str, tuple[float, float]] = {}
    wrap_calls(search, instrumented, lambda: search.search(prob, space, cfg.plan.top))
    parts.update({f"  {k} (instrumented)": v for k, v in instrumented.items()})
    every = timed(parts, "search (plan.top=0: all ranked; memo warm)", lambda: search.search(prob, space))
    timed(parts, "report: table", lambda: report.to_table(res.ranked, ["405b"], io.StringIO()))
    timed(parts, "report: json (every layout)", lambda: report.to_json(every.ranked, out=io.StringIO()))
    return parts


def wrap_calls(search: Any, parts: dict[str, tuple[float, float]], run: Callable[[], Any]) -> None:
    """Run the search again with its memory, bound and prediction calls timed: their share (memoised terms
    warm now; the wrappers add a little)."""
    names = {"problem_memory": "memory", "speed_bound": "bound", "predict": "predict"}
    originals = {name: getattr(search, name) for name in names}
    for name, fn in originals.items():
        setattr(search, name, _timer(parts, names[name], fn))
    try:
        run()
    finally:
        for name, fn in originals.items():
            setattr(search, name, fn)


def _timer(parts: dict[str, tuple[float, float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args: timed(parts, name, lambda: fn(*args))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench planner_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    console = Console(width=120)
    wall, cpu = fresh([str(BIN / "plan"), *COMMAND], args.repeats)
    table = Table(title=f"plan {' '.join(COMMAND)}: end to end, median of {args.repeats} fresh processes")
    for col in ("wall s", "CPU s", f"< {BUDGET_S} s"):
        table.add_column(col, justify="right")
    table.add_row(f"{wall:.3f}", f"{cpu:.3f}", "yes" if wall < BUDGET_S else "no")
    console.print(table)
    table = Table(title="the parts (interpreter and imports: fresh processes; the rest in this process)")
    for col in ("part", "wall s", "CPU s"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for name, (w, c) in breakdown(args.repeats).items():
        table.add_row(name, f"{w:.3f}", f"{c:.3f}")
    console.print(table)
    largest(console, args.repeats)


def largest(console: Console, repeats: int) -> None:
    table = Table(title=f"the largest space: 405b on {DEVICES:,} devices, 16M-token batch, CPU s (best of {repeats})")
    for col in ("hardware", "layouts tried", "fit", "CPU s"):
        table.add_column(col, justify="left" if col == "hardware" else "right")
    for hardware, per_node in HARDWARE:
        search_405b(hardware, per_node, TOP)  # warm: imports, memoised counts
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            res = search_405b(hardware, per_node, TOP)
            times.append(time.process_time() - t0)
        table.add_row(hardware, str(res.tried), str(res.fit), f"{min(times):.3f}")
    console.print(table)
