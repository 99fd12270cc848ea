"""Output of `plan`: a ranked table as wide as the terminal (or COLUMNS) lets every number stay whole,
every column in a log file or with `plan.format=wide`, or JSON (an array, one object per layout per line); with
`plan.tokens` the best layout's budget below the table (each layout's `budget` in JSON), with
`plan.compare` a table one row per profile (JSON: an object, `layouts` and `compare`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import textwrap
from typing import TextIO

from launcher.flops import GIB
from launcher.layout import Layout, degrees_text, dp_text, schedule_text
from launcher.planner.budget import DAY, HOUR, Budget, Row
from launcher.planner.columns import Columns
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


def fmt_rate(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


LOG_WIDTH = 220  # a file or a pipe told no width keeps every column, as a log should
SHORT = (  # the bottleneck's words where the full sentence does not fit (predict.bottleneck)
    (" communication", " comm"), ("tensor-parallel dispatch on the host", "TP host dispatch"),
    ("the chunked loss's weight traffic", "chunked loss"), ("the tied embedding's gradient all-reduce", "tied grads"),
    ("fp8 amax and cast passes", "fp8 casts"), ("pipeline sends", "pp sends"), ("pipeline bubble", "bubble"),
)  # fmt: skip


def width_of(out: TextIO) -> int:
    """The columns `out` shows: COLUMNS where set (a terminal, or a pipe told its width, as shutil reads
    it), else a terminal's own width; a file or pipe without COLUMNS: LOG_WIDTH."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return shutil.get_terminal_size().columns if out.isatty() else LOG_WIDTH


def _say(line: str, out: TextIO | None) -> None:
    """A line above or below a table: wrapped at a terminal's width (or COLUMNS), a log's whole."""
    out = out or sys.stdout
    out.write(_wrapped(line, out, indent=""))


def _print(table: Columns, out: TextIO | None) -> None:
    (out or sys.stdout).write(str(table))


def short_bottleneck(text: str) -> str:
    """`compute 84%`, `DP comm 31%`: predict.bottleneck's sentence without its link level and its detail."""
    name, _, detail = text.partition(" (")
    for long, short in SHORT:
        name = name.replace(long, short)
    return f"{name.split(' over ')[0]} {detail.split(' ')[0]}".strip()


def to_table(preds: list[Prediction], title: list[str], out: TextIO | None = None, wide: bool = False) -> None:
    """The ranking under its title lines: every column where they fit (a log file, a wide terminal, `wide`),
    else the columns a choice rests on, one line a layout: the bottleneck shortened, then a column the
    same in every row said once above the table, then the bottleneck of #1 alone, under it."""
    width = width_of(out or sys.stdout)
    for line in title:
        _say(line, out)
    full = full_table(preds)
    if wide or full.width <= width:
        return _print(full, out)  # `wide`: past the terminal's edge
    rows = [_compact_cells(p, i) for i, p in enumerate(preds, 1)]
    same = tuple(h for h in ("micro x m", "recompute") if len({row[h] for row in rows}) == 1)
    # then the batch split, then recompute too, even where the rows differ: `wide` has every column
    split, last = (True, (*same, "bottleneck", "micro x m")), (True, ("bottleneck", "micro x m", "recompute"))
    for short, moved in ((False, ()), (True, ()), (True, same), (True, (*same, "bottleneck")), split, last):
        table = compact_table(rows, short, moved)
        if table.width <= width:
            break
    if shared := [f"{h} {rows[0][h]}" for h in moved if h in same]:
        _say(f"in every layout: {', '.join(shared)}", out)
    _print(table, out)
    if "bottleneck" in moved:
        _say(f"bottleneck of #1: {preds[0].bottleneck} (every column: plan.format=wide)", out)


def _compact_cells(p: Prediction, rank: int) -> dict[str, str]:
    lay = p.layout
    return {
        "#": str(rank), "layout": degrees_text(lay), "micro x m": f"{lay.micro} x {lay.microbatches}",
        "recompute": _recompute(lay), "mem GiB": f"{p.memory.total / GIB:.1f}", "step s": f"{p.time.total:.3g}",
        "tokens/s": fmt_rate(p.tokens_per_s), "MFU": f"{p.mfu:.1%}", "bottleneck": p.bottleneck,
    }  # fmt: skip


def compact_table(rows: list[dict[str, str]], short: bool = False, moved: tuple[str, ...] = ()) -> Columns:
    """The ranking in fewer columns (`_compact_cells`): the layout in one cell (as the run's first line says
    it), memory, step time, tokens/s, MFU, the bottleneck (`short`: in a few words); `moved`: columns left
    out. The time's parts are in the whole table (a wide terminal, a log file, `plan.format=wide` or json)."""
    heads = tuple(h for h in rows[0] if h not in moved)
    table = Columns(heads, ("layout", "micro x m", "recompute", "bottleneck"))
    for row in rows:
        cells = {**row, "bottleneck": short_bottleneck(row["bottleneck"]) if short else row["bottleneck"]}
        table.add_row(*(cells[h] for h in heads))
    return table


HEADS = (
    "#", "dtype", "tp", "pp", "cp", "dp", "micro x m", "schedule", "recompute", "sp", "mem GiB", "ckpt GiB",
    "step s", "compute", "tp comm", "cp comm", "bubble", "dp exp", "tokens/s", "MFU", "bottleneck",
)  # fmt: skip


def full_table(preds: list[Prediction]) -> Columns:
    """Every column: the layout's degrees one by one, and the step time's parts."""
    table = Columns(HEADS, ("dtype", "dp", "micro x m", "schedule", "recompute", "bottleneck"))
    for i, p in enumerate(preds, 1):
        lay, t = p.layout, p.time
        table.add_row(
            str(i), p.dtype, str(lay.tp), str(lay.pp), str(lay.cp), dp_text(lay), f"{lay.micro} x {lay.microbatches}",
            schedule_text(lay), _recompute(lay),
            "y" if lay.sequence_parallel else "-", f"{p.memory.total / GIB:.1f}", f"{p.memory.checkpoint / GIB:.2g}",
            f"{t.total:.3g}", f"{t.compute:.3g}", f"{t.tp_comm + t.tp_host:.2g}", f"{t.cp_comm:.2g}",
            f"{t.pp_bubble:.2g}", f"{t.dp_exposed:.2g}", fmt_rate(p.tokens_per_s), f"{p.mfu:.1%}", p.bottleneck,
        )  # fmt: skip
    return table


def batch_text(global_batch: int | None, preds: list[Prediction], seq: int) -> str:
    """What the ranked layouts train a step: batch.global, or without it each layout's micro x microbatches x dp."""
    if global_batch:
        return f"global batch {global_batch:,} sequences of {seq:,} tokens (batch.global)"
    sizes = sorted({p.layout.global_batch for p in preds})
    span = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,} to {sizes[-1]:,}"
    return f"global batch {span} sequences of {seq:,} tokens: batch.global unset, each layout's micro x m x dp"


def precision_table(preds: list[Prediction], title: str, out: TextIO | None = None) -> None:
    """One layout in each dtype: its step, the fp8 casts, tokens/s, MFU against the bf16 peak and the fp8 one."""
    heads = ("dtype", "mem GiB", "step s", "compute", "fp8 cast", "dp exp", "tokens/s", "vs bf16", "MFU")
    table = Columns((*heads, "MFU fp8 peak"), ("dtype",))
    base = preds[0].tokens_per_s
    for p in preds:
        t = p.time
        table.add_row(
            p.dtype, f"{p.memory.total / GIB:.1f}", f"{t.total:.3g}", f"{t.compute:.3g}", f"{t.fp8_cast:.2g}",
            f"{t.dp_exposed:.2g}", fmt_rate(p.tokens_per_s), f"{p.tokens_per_s / base:.2f}x", f"{p.mfu:.1%}",
            "-" if p.mfu_fp8_peak is None else f"{p.mfu_fp8_peak:.1%}",
        )  # fmt: skip
    _say(title, out)
    _print(table, out)


def budget_block(b: Budget, machine: str, grouped: tuple[int, Budget] | None = None, out: TextIO | None = None) -> None:
    """The best layout's `plan.tokens` budget, each figure with what it follows from (planner/budget.py);
    `grouped`: the fastest layout with replica groups (its rank) under replica fault tolerance, and
    which of the two to use (planner/failures.py)."""
    out = out or sys.stdout
    gb = b.checkpoint_bytes / 1e9
    finish = (
        f"{b.days:.1f} days, {fmt_rate(b.device_hours)} device-hours"
        + (f", ${fmt_rate(b.cost)} at ${b.price_per_hour:.2f} per device-hour" if b.cost is not None else "")
        if b.goodput > 0
        else "never: failures come faster than a restart and half an interval (raise hardware.device_mtbf_hours?)"
    )
    lines = (
        f"Budget: {fmt_rate(b.tokens)} tokens on layout #1 ({b.devices:,} x {machine})",
        f"  steps       {b.steps:,} of {fmt_rate(b.tokens_per_step)} tokens, {b.step_time_s:.3g} s each: "
        f"{b.ideal_s / DAY:.1f} days without failures",
        f"  failures    one every {b.mtbf_s / HOUR:.3g} h (hardware.device_mtbf_hours="
        f"{b.mtbf_s * b.devices / HOUR:,.0f} / {b.devices:,} devices), "
        f"restart {b.restart_s:.0f} s (hardware.restart_s)",
        f"  checkpoint  {gb:.3g} GB per device, saved in {b.save_s:.3g} s "
        f"(hardware.storage_gbs={gb / b.save_s:.3g} GB/s per device)",
        f"  Young-Daly  sqrt(2 x {b.save_s:.3g} s x {b.mtbf_s:.4g} s) = {b.interval_s:.4g} s between saves: "
        f"checkpoint.every={b.checkpoint_every}",
        f"  goodput     {b.goodput:.1%}: {finish}",
        *_replica_ft_lines(b, grouped),
    )
    out.write("".join(_wrapped(line, out) for line in lines))


def _wrapped(line: str, out: TextIO, indent: str = " " * 14) -> str:
    """`line` wrapped at a terminal's width (or COLUMNS), by default under its figure's name; a log whole (no
    hard wrap)."""
    if not (os.environ.get("COLUMNS") or out.isatty()):
        return line + "\n"
    return textwrap.fill(line, width_of(out), subsequent_indent=indent, break_on_hyphens=False) + "\n"


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


COMPARED = ("nodes", "devices", "layout", "step s", "tokens/s", "MFU")  # then the budget's columns


def compare_table(rows: list[Row], tokens: float, what: str, out: TextIO | None = None) -> None:
    """`plan.compare`: one row per profile, its best layout and that layout's budget for `tokens` of `what`;
    in two tables (the layout's, the budget's) where one does not fit, a profile that fits no layout under them."""
    cells = [_compared(row) for row in rows]
    _say(compare_title(tokens, what), out)
    heads = tuple(cells[0])
    parts = [heads, heads[: len(COMPARED) + 1], (heads[0], *heads[len(COMPARED) + 1 :])]
    tables = [Columns(part, ("hardware", "layout")) for part in parts]
    for table in tables:
        for row in cells:
            table.add_row(*(row[h] for h in table.heads))
    for table in tables[:1] if tables[0].width <= width_of(out or sys.stdout) else tables[1:]:
        _print(table, out)
    for row in rows:
        if row.error is not None:
            _say(f"{row.hardware.name}: {row.error}", out)


def compare_title(tokens: float, what: str) -> str:
    """The heading of `plan.compare`'s table and of its chart (planner/charts.py)."""
    return f"plan.compare: {fmt_rate(tokens)} tokens of {what}"


def _compared(row: Row) -> dict[str, str]:
    """One `plan.compare` row's cells: hardware, COMPARED, then the budget ("-" where no layout fits)."""
    p, b = row.prediction, row.budget
    heads = ("hardware", *COMPARED, "ckpt every", "goodput", "days", "device-h", "$/device-h", "cost $")
    if p is None or b is None:
        return dict(zip(heads, (row.hardware.name, str(row.nodes), f"{row.devices:,}", "none fits (below)"),
                        strict=False)) | dict.fromkeys(heads[4:], "-")  # fmt: skip
    ran = b.goodput > 0
    return dict(zip(heads, (
        row.hardware.name, f"{row.nodes:,}", f"{row.devices:,}", degrees_text(p.layout), f"{p.step_time_s:.3g}",
        fmt_rate(p.tokens_per_s), f"{p.mfu:.1%}", str(b.checkpoint_every), f"{b.goodput:.1%}",
        f"{b.days:.1f}" if ran else "never", fmt_rate(b.device_hours) if ran else "-",
        "-" if b.price_per_hour is None else f"{b.price_per_hour:.2f}",
        "-" if b.cost is None or not ran else fmt_rate(b.cost),
    ), strict=True))  # fmt: skip
