"""Output of `plan`: a ranked rich table, or JSON (an array, one object per layout per line); with
`plan.tokens` the best layout's budget below the table (each layout's `budget` in JSON), with
`plan.compare` a table one row per profile (JSON: an object, `layouts` and `compare`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from typing import Any, TextIO

from launcher.flops import GIB
from launcher.layout import Layout, degrees_text, dp_text, schedule_text
from launcher.planner.budget import DAY, HOUR, Budget, Row
from launcher.planner.failures import MARGIN, ReplicaFt, prefer_ft
from launcher.planner.predict import Prediction


def to_json(
    preds: list[Prediction],
    budgets: list[Budget] | None = None,
    compare: list[Row] | None = None,
    out: TextIO | None = None,
) -> None:
    out = out or sys.stdout
    layouts = [{**p.as_dict(), **({"budget": budgets[i].as_dict()} if budgets else {})} for i, p in enumerate(preds)]
    rows = ",\n".join(json.dumps(layout) for layout in layouts)
    if compare is None:
        out.write("[\n" + rows + "\n]\n")
        return
    compared = ",\n".join(json.dumps(row.as_dict()) for row in compare)
    out.write('{"layouts": [\n' + rows + '\n],\n"compare": [\n' + compared + "\n]}\n")


def _recompute(lay: Layout) -> str:
    return lay.recompute + (f" +{lay.recompute_layers} full" if lay.recompute_layers else "")


def _fmt_rate(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


WIDE = 200  # columns the whole table needs; a log file gets it all (220)


def compact_table(preds: list[Prediction], title: str) -> Any:
    """The ranking for a terminal under WIDE columns: the layout in one cell (as the run's first line
    says it), memory, step time, tokens/s, MFU and what bounds the step; every number whole, the text
    cells wrapped. The time's parts are in the whole table (a log file, `plan.format=json`)."""
    from rich.table import Table

    dtype = {p.dtype for p in preds}
    table = Table(title=f"{title} ({', '.join(sorted(dtype))})", title_justify="left")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("layout", min_width=20)
    for head in ("micro x m", "recompute"):
        table.add_column(head, no_wrap=True)
    for head in ("mem GiB", "step s", "tokens/s", "MFU"):
        table.add_column(head, justify="right", no_wrap=True)
    table.add_column("bottleneck", min_width=16)
    for i, p in enumerate(preds, 1):
        lay = p.layout
        table.add_row(
            str(i), degrees_text(lay), f"{lay.micro} x {lay.microbatches}", _recompute(lay),
            f"{p.memory.total / GIB:.1f}", f"{p.time.total:.3g}", _fmt_rate(p.tokens_per_s), f"{p.mfu:.1%}",
            p.bottleneck,
        )  # fmt: skip
    return table


def to_table(preds: list[Prediction], title: str, out: TextIO | None = None) -> None:
    """The ranking: every column where there is room for it (a log file, a wide terminal), else the
    columns a choice rests on."""
    from rich.console import Console

    out = out or sys.stdout
    # a terminal's own width (COLUMNS first, as shutil reads it; rich takes 80 for TERM=dumb unless told
    # both dimensions); a log file every column
    size = shutil.get_terminal_size() if out.isatty() else os.terminal_size((220, 25))
    console = Console(file=out, width=size.columns, height=size.lines)
    console.print(full_table(preds, title) if console.width >= WIDE else compact_table(preds, title))


HEADS = (
    "#", "dtype", "tp", "pp", "cp", "dp", "micro x m", "schedule", "recompute", "sp", "mem GiB", "ckpt GiB",
    "step s", "compute", "tp comm", "cp comm", "bubble", "dp exp", "tokens/s", "MFU", "bottleneck",
)  # fmt: skip


def full_table(preds: list[Prediction], title: str) -> Any:
    """Every column: the layout's degrees one by one, and the step time's parts."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in HEADS:
        table.add_column(h, justify="left" if h in ("dp", "schedule", "recompute", "bottleneck") else "right")
    for i, p in enumerate(preds, 1):
        lay, t = p.layout, p.time
        table.add_row(
            str(i), p.dtype, str(lay.tp), str(lay.pp), str(lay.cp), dp_text(lay), f"{lay.micro} x {lay.microbatches}",
            schedule_text(lay), _recompute(lay),
            "y" if lay.sequence_parallel else "-", f"{p.memory.total / GIB:.1f}", f"{p.memory.checkpoint / GIB:.2g}",
            f"{t.total:.3g}", f"{t.compute:.3g}", f"{t.tp_comm + t.tp_host:.2g}", f"{t.cp_comm:.2g}",
            f"{t.pp_bubble:.2g}", f"{t.dp_exposed:.2g}", _fmt_rate(p.tokens_per_s), f"{p.mfu:.1%}", p.bottleneck,
        )  # fmt: skip
    return table


def precision_table(preds: list[Prediction], title: str, out: TextIO | None = None) -> None:
    """One layout in each dtype: its step, the fp8 casts, tokens/s, MFU against the bf16 peak and the fp8 one."""
    from rich.console import Console
    from rich.table import Table

    out = out or sys.stdout
    table = Table(title=title, title_justify="left")
    heads = (
        "dtype",
        "mem GiB",
        "step s",
        "compute",
        "fp8 cast",
        "dp exp",
        "tokens/s",
        "vs bf16",
        "MFU",
        "MFU fp8 peak",
    )
    for h in heads:
        table.add_column(h, justify="left" if h == "dtype" else "right")
    base = preds[0].tokens_per_s
    for p in preds:
        t = p.time
        table.add_row(
            p.dtype,
            f"{p.memory.total / GIB:.1f}",
            f"{t.total:.3g}",
            f"{t.compute:.3g}",
            f"{t.fp8_cast:.2g}",
            f"{t.dp_exposed:.2g}",
            _fmt_rate(p.tokens_per_s),
            f"{p.tokens_per_s / base:.2f}x",
            f"{p.mfu:.1%}",
            "-" if p.mfu_fp8_peak is None else f"{p.mfu_fp8_peak:.1%}",
        )
    Console(file=out, width=None if out.isatty() else 220).print(table)


def budget_block(b: Budget, machine: str, grouped: tuple[int, Budget] | None = None, out: TextIO | None = None) -> None:
    """The best layout's `plan.tokens` budget, each figure with what it follows from (planner/budget.py);
    `grouped`: the fastest layout with replica groups (its rank) under replica fault tolerance, and
    which of the two to use (planner/failures.py)."""
    out = out or sys.stdout
    gb = b.checkpoint_bytes / 1e9
    finish = (
        f"{b.days:.1f} days, {_fmt_rate(b.device_hours)} device-hours"
        + (f", ${_fmt_rate(b.cost)} at ${b.price_per_hour:.2f} per device-hour" if b.cost is not None else "")
        if b.goodput > 0
        else "never: failures come faster than a restart and half an interval (raise hardware.device_mtbf_hours?)"
    )
    lines = (
        f"Budget: {_fmt_rate(b.tokens)} tokens on layout #1 ({b.devices} x {machine})",
        f"  steps       {b.steps:,} of {_fmt_rate(b.tokens_per_step)} tokens, {b.step_time_s:.3g} s each: "
        f"{b.ideal_s / DAY:.1f} days without failures",
        f"  failures    one every {b.mtbf_s / HOUR:.3g} h (hardware.device_mtbf_hours="
        f"{b.mtbf_s * b.devices / HOUR:,.0f} / {b.devices} devices), restart {b.restart_s:.0f} s (hardware.restart_s)",
        f"  checkpoint  {gb:.3g} GB per device, saved in {b.save_s:.3g} s "
        f"(hardware.storage_gbs={gb / b.save_s:.3g} GB/s per device)",
        f"  Young-Daly  sqrt(2 x {b.save_s:.3g} s x {b.mtbf_s:.4g} s) = {b.interval_s:.4g} s between saves: "
        f"checkpoint.every={b.checkpoint_every}",
        f"  goodput     {b.goodput:.1%}: {finish}",
        *_replica_ft_lines(b, grouped),
    )
    out.write("\n".join(lines) + "\n")


def _replica_ft_lines(b: Budget, grouped: tuple[int, Budget] | None) -> tuple[str, ...]:
    """Replica fault tolerance on the fastest layout with replica groups beside layout #1's full restarts."""
    if grouped is None:
        return (
            "  replica ft  no layout here has replica groups (dp_replicate > 1, dividing ft.replicas): full restarts",
        )
    rank, g = grouped
    ft = g.replica_ft
    assert isinstance(ft, ReplicaFt)
    keys = f"ft.replicas={ft.replicas} ft.min_replicas={ft.min_replicas}"
    stops = f"{ft.stop_mtbf_s / HOUR:.3g} h" if math.isfinite(ft.stop_mtbf_s) else "never (first order)"
    days = f"{g.ft_wall_s / DAY:.1f} days" if math.isfinite(g.ft_wall_s) else "never"
    own = f"{b.days:.1f} days" if b.goodput > 0 else "never"
    verdict = (
        f"use layout #{rank} with {keys} (checkpoint.every={ft.checkpoint_every})"
        if prefer_ft(b.wall_s, g.ft_wall_s)
        else f"full restarts on layout #1 (ft saves under {MARGIN:.0%})"
    )
    return (
        f"  replica ft  layout #{rank} with {keys}: a failure stops one group for {ft.downtime_s:.3g} s "
        f"(restart + {ft.heal_s:.3g} s healing from a peer), the whole job every {stops}",
        f"              goodput {ft.goodput:.1%} at {g.step_time_s:.3g} s a step: {days}, against {own} for layout #1 "
        f"with full restarts: {verdict}",
    )


def compare_table(rows: list[Row], tokens: float, what: str, out: TextIO | None = None) -> None:
    """`plan.compare`: one row per profile, its best layout and that layout's budget for `tokens` of `what`."""
    from rich.console import Console
    from rich.table import Table

    out = out or sys.stdout
    table = Table(title=f"plan.compare: {_fmt_rate(tokens)} tokens of {what}", title_justify="left")
    heads = ("hardware", "nodes", "devices", "layout", "step s", "tokens/s", "MFU", "ckpt every", "goodput")
    for h in (*heads, "days", "device-h", "$/device-h", "cost $"):
        table.add_column(h, justify="left" if h in ("hardware", "layout") else "right")
    for row in rows:
        p, b = row.prediction, row.budget
        if p is None or b is None:
            table.add_row(row.hardware.name, str(row.nodes), str(row.devices), row.error, *["-"] * 9)
            continue
        lay = p.layout
        shape = f"tp {lay.tp} pp {lay.pp} cp {lay.cp} dp {dp_text(lay)}" + (
            f" {schedule_text(lay)}" if lay.pp > 1 else ""
        )
        table.add_row(
            row.hardware.name,
            str(row.nodes),
            str(row.devices),
            shape,
            f"{p.step_time_s:.3g}",
            _fmt_rate(p.tokens_per_s),
            f"{p.mfu:.1%}",
            str(b.checkpoint_every),
            f"{b.goodput:.1%}",
            f"{b.days:.1f}" if b.goodput > 0 else "never",
            _fmt_rate(b.device_hours) if b.goodput > 0 else "-",
            "-" if b.price_per_hour is None else f"{b.price_per_hour:.2f}",
            "-" if b.cost is None or b.goodput <= 0 else _fmt_rate(b.cost),
        )
    Console(file=out, width=None if out.isatty() else 220).print(table)
