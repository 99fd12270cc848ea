"""The end of a run for people: what it measured beside what the planner predicted, in words and units.
summary.json keeps its keys for programs (plan.calibrate, sweeps); this only shows them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from launcher.config.precision import MODE_TEXT
from launcher.layout import Layout
from launcher.layout.text import degrees_text

Row = tuple[str, str, str, str]  # label, measured, predicted, ratio: measured / predicted
LOSSES = (("final_loss", "loss"), ("val_loss", "val loss"), ("smoke_loss", "smoke step loss"))
STOPPED = (
    ("preempted_at_step", "preempted at step"),
    ("resumed_at_step", "resumed at step"),
    ("checkpoint", "checkpoint"),
)
LABEL_WIDTH = 20  # the longest label ("peak memory GiB/rank"): both tables' values start in one column


def count(n: float) -> str:
    """A count read at a glance: `950`, `125.2 k`, `12.5 M`, `1.24 B`."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.{2 if abs(n) < 10 * scale else 1}f} {unit}"
    return f"{n:,.0f}"


def size(nbytes: float) -> str:
    """Bytes in binary units: `512 B`, `368.0 KiB`, `1.2 GiB`."""
    if abs(nbytes) < 1024:
        return f"{nbytes:,.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if abs(nbytes) < 1024 or unit == "TiB":
            break
    return f"{nbytes:,.1f} {unit}"


def duration(seconds: float) -> str:
    """`168 ms`, `8.7 s`, `2 min 05 s`, `1 h 02 min`."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def percent(share: float) -> str:
    """`7.0%`; a share under 0.1% keeps two digits (`0.042%`) rather than reading as none."""
    return f"{share:.1%}" if share >= 1e-3 or share == 0 else f"{share * 100:.2g}%"


MOE = (
    ("moe_load_imbalance", "MoE load imbalance", lambda v: f"{v:.2f} (max / mean tokens per expert)"),
    ("moe_dropped_share", "MoE tokens dropped", percent),
    ("moe_bias_abs_mean", "MoE router bias", lambda v: f"{v:.3g} (mean |bias|)"),
)


def spread(per_rank: list[float], text: Callable[[float], str]) -> str:
    """Every rank's figure as `min / max`, the worst rank named; one figure where they read the same."""
    low, high = min(per_rank), max(per_rank)
    if text(low) == text(high):
        return text(high)
    return f"{text(low)} / {text(high)} (max on rank {per_rank.index(high)})"


def beside(label: str, measured: float, predicted: float | None, text: Callable[[float], str], shown: str = "") -> Row:
    """A measured figure, the planner's, and their ratio (blank where the planner has none)."""
    ratio = f"{measured / predicted:.2f}×" if predicted else ""
    return label, shown or text(measured), text(predicted) if predicted else "", ratio


def tokens_per_step(summary: dict[str, Any]) -> int | None:
    """The global batch in tokens, as the meter counts it: the layout's global batch x seq_len."""
    if "layout" not in summary or "seq_len" not in summary.get("config", {}):
        return None
    return Layout(**summary["layout"]).global_batch * summary["config"]["seq_len"]


def compared(summary: dict[str, Any], pred: dict[str, Any]) -> list[Row]:
    """The figures the planner predicts, measured (medians over the steps after the first) beside it."""
    rows = []
    if (tps := summary.get("median_tokens_per_s")) is not None:
        rows.append(beside("tokens/s", tps, pred.get("tokens_per_s"), "{:,.0f}".format))
        rows.append(beside("MFU", summary["median_mfu"], pred.get("mfu"), percent))
        if (fp8 := summary.get("median_mfu_fp8_peak")) is not None:
            rows.append(beside("MFU of the fp8 peak", fp8, pred.get("mfu_fp8_peak"), percent))
        rows.append(("TFLOP/s/device", f"{summary['median_tflops_per_device']:.3g}", "", ""))
        if tokens := tokens_per_step(summary):  # every step trains the same tokens: the median step's time
            rows.append(beside("step time", tokens / tps, pred.get("step_time_s"), duration))
    if per_rank := summary.get("peak_mem_gib_per_rank"):
        gib = spread(per_rank, "{:.2f}".format)
        predicted = summary.get("predicted_build_gib", pred.get("memory_gib"))  # steps=0: what a build holds
        rows.append(beside("peak memory GiB/rank", max(per_rank), predicted, "{:.2f}".format, gib))
    if per_rank := summary.get("checkpoint_bytes_per_rank"):
        predicted = pred.get("checkpoint_bytes_per_rank")
        rows.append(beside("checkpoint size/rank", max(per_rank), predicted, size, spread(per_rank, size)))
    return rows


def losses(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The losses, a dry build's smoke step, a mixture's shares, MoE balance at the last step."""
    rows = [(label, f"{summary[k]:.4f}") for k, label in LOSSES if summary.get(k) is not None]
    if summary.get("build_time_s") is not None:
        rows.append(("build time", duration(summary["build_time_s"])))
    for key, share in summary.items():
        if key.startswith("share."):
            source = key.removeprefix("share.")
            rows.append((f"source {source}", f"{percent(share)} of tokens ({count(summary[f'tokens.{source}'])})"))
    for key, label, text in MOE:
        if summary.get(key) is not None:
            rows.append((label, text(summary[key])))
    return rows


def how(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """How the run ran: size, numbers, compile, guard, ft, checkpoint saves, wall clock."""
    rows = [("parameters", count(summary["params"]))] if "params" in summary else []
    if "precision" in summary:
        rows.append(("precision", precision(summary)))
    if compiled := summary.get("compiled"):
        graphs, breaks = compiled["graphs"], compiled["graph_breaks"]
        rows.append(("compile", f"{compiled['units']} modules into {graphs} graphs, {breaks or 'no'} graph breaks"))
    if summary.get("skipped_steps"):
        rows.append(("skipped steps", f"{summary['skipped_steps']:,} (non-finite loss or gradients)"))
    if "ft_short_steps" in summary:
        short = summary["ft_short_steps"]
        missed = f"{len(short)} short of a replica group, {summary['ft_tokens_missed']:,} tokens not trained on"
        rows.append(("ft steps", missed if short else "every replica group in every step"))
    if saves := summary.get("checkpoint_save_s"):
        n = saves["count"]
        rows.append(("checkpoint saves", f"{n} save{'s' * (n != 1)}, {duration(saves['median'])}{' median' * (n > 1)}"))
    if "wall_time_s" in summary:
        rows.append(("wall time", duration(summary["wall_time_s"])))
    if "optimizer_impl" in summary:
        rows.append(("runtime", runtime(summary)))
    return rows


def precision(summary: dict[str, Any]) -> str:
    """As run: fp32, bf16 (how), or fp8 on so many layers (launcher/parallel/float8.py `report`)."""
    text = MODE_TEXT.get(summary["precision"], summary["precision"])  # summary.json says it in words already
    if fp8 := summary.get("fp8"):
        kept = sum(entry["count"] for entry in fp8["high_precision"])
        text += f": {sum(fp8['converted'].values())} layers in fp8, {kept} kept high precision"
    return text


def runtime(summary: dict[str, Any]) -> str:
    """The implementations the run picked: optimizer, threads, allocator, MoE experts."""
    threads = summary.get("threads_per_worker", 1)
    parts = [f"{summary['optimizer_impl']} optimizer", f"{threads} thread{'s' * (threads != 1)}/worker"]
    if "cpu_allocator" in summary:
        parts.append(f"{summary['cpu_allocator']} CPU allocator")
    if "expert_impl" in summary:
        parts.append(f"MoE experts {summary['expert_impl']}")
    return " · ".join(parts)


def title(summary: dict[str, Any]) -> str:
    """`summary · tiny · tp 2 · dp 2 fsdp · 20 steps`: what ran, in the run's first line's words."""
    parts = ["summary", str(summary.get("model", ""))]
    parts.append(degrees_text(Layout(**summary["layout"])) if "layout" in summary else "")
    if "steps" in summary:
        parts.append(f"{summary['steps']:,} steps" if summary["steps"] else "built, not trained (steps=0)")
    return " · ".join(p for p in parts if p)


def notes(summary: dict[str, Any], pred: dict[str, Any]) -> list[str]:
    """Lines under the table: what limits the predicted step, what the memory figure measures."""
    lines = []
    if pred:
        fits = "" if pred.get("fits", True) else "; predicted not to fit in memory"
        lines.append(f"planner ({pred.get('hardware', '?')}): bottleneck {pred.get('bottleneck', '?')}{fits}")
    if "peak_mem_measure" in summary and "peak_mem_gib_per_rank" in summary:
        lines.append(f"memory measured as {summary['peak_mem_measure']}")
    if summary.get("median_mfu", 0) > 1 and "cpu_allocator" in summary:  # faster than the peak: it was cached low
        lines.append(
            "MFU above 100%: this CPU's cached GEMM peak was measured on a busy machine; `doctor` re-measures it"
        )
    return lines


def details(summary: dict[str, Any]) -> Text:
    """Label and value, in words: what has no prediction to stand beside. Lines, not a grid: a grid pads
    every line out to its widest (trailing spaces in every log)."""
    stopped = [(label, str(summary[k])) for k, label in STOPPED if k in summary]
    rows = [*losses(summary), *how(summary), *stopped]
    return Text("\n".join(f"  {label:<{LABEL_WIDTH}}  {text}" for label, text in rows))


def summary_view(summary: dict[str, Any]) -> Group:
    """The summary: the measured figures (beside the planner's where it predicted the run), the rest in
    words under them, then notes."""
    pred = summary.get("prediction") or {}
    figures = compared(summary, pred)
    table = Table(header_style="bold")
    for name in ("", "measured", *(("predicted", "ratio") if pred else ())):
        table.add_column(name, justify="right" if name else "left", min_width=LABEL_WIDTH if not name else None)
    for row in figures:
        table.add_row(*row[: len(table.columns)])
    return Group(title(summary), *([table] if figures else []), details(summary), *notes(summary, pred))
