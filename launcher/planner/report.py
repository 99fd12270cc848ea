"""Output of `plan`: a ranked rich table, or JSON (an array, one object per layout per line)."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from launcher.flops import GIB
from launcher.planner.predict import Prediction


def to_json(preds: list[Prediction], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    rows = [json.dumps(p.as_dict()) for p in preds]
    out.write("[\n" + ",\n".join(rows) + "\n]\n")


def _dp(p: Prediction) -> str:
    lay = p.layout
    zero2 = " zero2" if lay.dp_shard > 1 and not lay.reshard_after_forward else ""
    if lay.sharding == "hsdp":
        return f"{lay.dp_replicate}x{lay.dp_shard} hsdp{zero2}"
    return f"{lay.dp} {lay.sharding}{zero2}" if lay.dp > 1 else "1"


def _schedule(p: Prediction) -> str:
    lay = p.layout
    if lay.pp == 1:
        return "-"
    if lay.schedule == "interleaved_1f1b":
        return f"interleaved x{lay.chunks}"
    return f"{lay.schedule} x{lay.chunks}" if lay.schedule == "interleaved_zb" else lay.schedule


def _fmt_rate(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def to_table(preds: list[Prediction], title: str, out: TextIO | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    out = out or sys.stdout
    console = Console(file=out, width=None if out.isatty() else 220)
    table = Table(title=title, title_justify="left")
    heads = (
        "#",
        "tp",
        "pp",
        "cp",
        "dp",
        "micro x m",
        "schedule",
        "recompute",
        "sp",
        "mem GiB",
        "ckpt GiB",
        "step s",
        "compute",
        "tp comm",
        "cp comm",
        "bubble",
        "dp exp",
        "tokens/s",
        "MFU",
        "bottleneck",
    )
    for h in heads:
        table.add_column(h, justify="left" if h in ("dp", "schedule", "recompute", "bottleneck") else "right")
    for i, p in enumerate(preds, 1):
        lay, t = p.layout, p.time
        table.add_row(
            str(i),
            str(lay.tp),
            str(lay.pp),
            str(lay.cp),
            _dp(p),
            f"{lay.micro} x {lay.microbatches}",
            _schedule(p),
            lay.recompute + (f" +{lay.recompute_layers} full" if lay.recompute_layers else ""),
            "y" if lay.sequence_parallel else "-",
            f"{p.memory.total / GIB:.1f}",
            f"{p.memory.checkpoint / GIB:.2g}",
            f"{t.total:.3g}",
            f"{t.compute:.3g}",
            f"{t.tp_comm + t.tp_host:.2g}",
            f"{t.cp_comm:.2g}",
            f"{t.pp_bubble:.2g}",
            f"{t.dp_exposed:.2g}",
            _fmt_rate(p.tokens_per_s),
            f"{p.mfu:.1%}",
            p.bottleneck,
        )
    console.print(table)
