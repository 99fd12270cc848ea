"""A layout for people, one way everywhere: the run's first line, the planner's tables, the dry run.
Only what differs from one plain process is named: `tp 2 sp · pp 4 interleaved x2 · dp 2x4 hsdp ·
selective recompute · micro 8 x 4`."""

from __future__ import annotations

from launcher.layout.core import Layout


def dp_text(lay: Layout) -> str:
    """The data-parallel degree and how it shards: `8 fsdp`, `2x4 hsdp zero2`, `2 ddp`, `1`."""
    zero2 = " zero2" if lay.dp_shard > 1 and not lay.reshard_after_forward else ""
    if lay.sharding == "hsdp":
        return f"{lay.dp_replicate}x{lay.dp_shard} hsdp{zero2}"
    return f"{lay.dp} {lay.sharding}{zero2}" if lay.dp > 1 else "1"


def schedule_text(lay: Layout) -> str:
    """The pipeline schedule with its virtual stages: `1f1b`, `interleaved x2`, `zbv`; `-` without pp."""
    return lay.pipe.text(lay.chunks) if lay.pp > 1 else "-"


def degrees_text(lay: Layout) -> str:
    """The parallel degrees alone: `tp 2 sp · pp 4 interleaved x2 · dp 2x4 hsdp`, or `one process`."""
    parts = [f"tp {lay.tp}" + (" sp" if lay.sequence_parallel else "")] if lay.tp > 1 else []
    parts += [f"pp {lay.pp} {schedule_text(lay)}"] if lay.pp > 1 else []
    parts += [f"{name} {degree}" for name, degree in (("cp", lay.cp), ("ep", lay.ep)) if degree > 1]
    parts += [f"dp {dp_text(lay)}"] if lay.dp > 1 else []
    return " · ".join(parts or ["one process"])


def describe(lay: Layout) -> str:
    """The whole layout in one line (module docstring)."""
    parts = [degrees_text(lay)]
    if lay.recompute != "none" or lay.recompute_layers:
        full = f"{lay.recompute_layers} blocks full" if lay.recompute_layers else ""
        parts.append(
            " + ".join(x for x in (lay.recompute if lay.recompute != "none" else "", full) if x) + " recompute"
        )
    return " · ".join([*parts, f"micro {lay.micro} x {lay.microbatches}"])
