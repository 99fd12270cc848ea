"""The end of a multirun: one summary of every sweep point, measured beside predicted.

`SweepSummary` is a Hydra callback (launcher/conf/train.yaml: hydra.callbacks). On `on_multirun_end` it reads
each job's summary.json in the sweep directory and writes there:
- `sweep_summary.csv` / `sweep_summary.json`: one row per job (overrides, layout, measured and
  predicted tokens/s and MFU, loss, memory, status, error);
- `sweep_summary.png`: measured tokens/s and MFU per layout beside the planner's prediction;
and prints a rich table, then the failed points with their errors.

`sweep_point` wraps one job of a multirun: bad input or a failed worker is written to the job's
summary.json as {"status": "failed", "error", "error_type", "exit_code"} (from the exception object)
instead of ending the whole sweep.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from launcher.charts import pyplot, save
from launcher.config.extras import install_hint, installed
from launcher.errors import FAILED, LauncherError
from launcher.metrics.charts import loss_lines, read_rows

FIELDS = (
    "job",
    "point",
    "overrides",
    "layout",
    "status",
    "tokens_per_s",
    "predicted_tokens_per_s",
    "mfu",
    "predicted_mfu",
    "final_loss",
    "peak_mem_gib",
    "predicted_memory_gib",
    "world_size",
    "global_batch",
    "wall_time_s",
    "error",
    "error_type",
    "exit_code",
    "dir",
)
LAYOUT_KEYS = ("tp", "pp", "dp_replicate", "dp_shard")


def multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def record_failure(run_dir: Path, err: Exception) -> None:
    """A failed sweep point: summary.json records the exception (rank 0 / the first writer only)."""
    error = str(err) if isinstance(err, LauncherError) else f"{type(err).__name__}: {err}"
    failure = {
        "status": "failed",
        "error": error or "failed (no message)",
        "error_type": type(err).__name__,
        "exit_code": err.exit_code if isinstance(err, LauncherError) else FAILED,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "summary.json"
    if not path.exists():
        path.write_text(json.dumps(failure, indent=2) + "\n")
    print(f"sweep point failed: {failure['error']}", file=sys.stderr)


@contextlib.contextmanager
def sweep_point(run_dir: Path | None) -> Iterator[None]:
    """In a multirun, record this job's failure instead of ending the sweep; outside one, do nothing.
    A SystemExit (a preempted point exits to be requeued) is not a failure and passes through."""
    if not multirun():
        yield
        return
    try:
        yield
    except Exception as err:  # bad input, a failed worker, or a crash: the other points go on
        record_failure(Path(run_dir or HydraConfig.get().runtime.output_dir), err)


# --- collecting ------------------------------------------------------------------------------------
def _layout_label(layout: dict[str, Any] | None, overrides: list[str]) -> str:
    if layout:
        rep, shard = layout.get("dp_replicate", 1), layout.get("dp_shard", 1)
        label = f"tp{layout.get('tp', 1)} pp{layout.get('pp', 1)} dp{rep * shard}"
        if rep > 1 and shard > 1:
            label += f" hsdp {rep}x{shard}"
        elif rep * shard > 1:
            label += " fsdp" if shard > 1 else " ddp"
        return label
    return " ".join(o for o in overrides if o.split("=")[0] in ("tp", "pp", "dp")) or "-"


def _job_dirs(sweep_dir: Path) -> list[Path]:
    dirs = [p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")]
    dirs += [p.parent for p in sweep_dir.glob("*/summary.json") if p.parent not in dirs]
    return sorted(set(dirs), key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of the sweep."""
    rows = []
    for job_dir in _job_dirs(sweep_dir):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = list(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
        summary_file = job_dir / "summary.json"
        summary: dict[str, Any] = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        if not summary:
            status, error = "failed", f"no summary.json: the job did not finish (logs in {job_dir})"
        elif summary.get("status") == "failed":
            status, error = "failed", summary["error"]
        elif "preempted_at_step" in summary:
            status, error = "preempted", f"preempted at step {summary['preempted_at_step']}"
        else:
            status, error = "ok", ""
        pred = summary.get("prediction") or {}
        rows.append(
            {
                "job": job_dir.name,
                "overrides": " ".join(str(o) for o in overrides),
                "layout": _layout_label(summary.get("layout"), [str(o) for o in overrides]),
                "status": status,
                "tokens_per_s": summary.get("median_tokens_per_s"),
                "predicted_tokens_per_s": pred.get("tokens_per_s"),
                "mfu": summary.get("median_mfu"),
                "predicted_mfu": pred.get("mfu"),
                "final_loss": summary.get("final_loss"),
                "peak_mem_gib": summary.get("peak_mem_gib"),
                "predicted_memory_gib": pred.get("memory_gib"),
                "world_size": summary.get("world_size"),
                "global_batch": pred.get("global_batch"),
                "wall_time_s": summary.get("wall_time_s"),
                "error": error,
                "error_type": summary.get("error_type"),
                "exit_code": summary.get("exit_code"),
                "dir": str(job_dir),
            }
        )
    common = set.intersection(*(set(r["overrides"].split()) for r in rows)) if len(rows) > 1 else set()
    for r in rows:  # what sets this point apart from the others
        r["point"] = " ".join(o for o in r["overrides"].split() if o not in common) or r["overrides"]
    return rows


def batch_note(rows: list[dict[str, Any]]) -> str | None:
    """The line that says the points trained different global batches (without batch.global, a pp=2
    point trains twice or more the sequences of a pp=1 point): their tokens/s and losses are not alike."""
    batches = {r["point"]: r["global_batch"] for r in rows if r["global_batch"]}
    if len(set(batches.values())) < 2:
        return None
    each = ", ".join(f"{point}: {batch}" for point, batch in batches.items())
    return f"note: the points trained different global batches ({each}): set batch.global to compare like with like"


OFF = 3.0  # measured and predicted tokens/s this many times apart: not the planner's error alone


def off_note(rows: list[dict[str, Any]]) -> str | None:
    """The line that says some points ran far from their prediction: on a busy machine (other work on
    the cores) or against a calibration cached on one, the predicted column is no guide."""
    off = [
        f"{r['point']}: {r['tokens_per_s'] / r['predicted_tokens_per_s']:.2g}x"
        for r in rows
        if r["tokens_per_s"] and r["predicted_tokens_per_s"]
        and not 1 / OFF <= r["tokens_per_s"] / r["predicted_tokens_per_s"] <= OFF
    ]  # fmt: skip
    if not off:
        return None
    load = f", load now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else ""
    return (
        f"note: measured tokens/s {OFF:g}x or more off the prediction ({', '.join(off)}{load}): a busy machine, "
        "or a calibration cached on one (`doctor` re-measures the peak)"
    )


# --- writing -----------------------------------------------------------------------------------------
def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{value:.2%}"
    if kind == "int":
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_table(rows: list[dict[str, Any]], title: str, file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for name, justify in (
        ("#", "right"),
        ("point", "left"),
        ("layout", "left"),
        ("tokens/s", "right"),
        ("predicted", "right"),
        ("MFU", "right"),
        ("predicted", "right"),
        ("loss", "right"),
        ("mem GiB", "right"),
        ("predicted", "right"),
        ("status", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            r["job"],
            r["point"],
            r["layout"],
            _fmt(r["tokens_per_s"], "int"),
            _fmt(r["predicted_tokens_per_s"], "int"),
            _fmt(r["mfu"], "pct"),
            _fmt(r["predicted_mfu"], "pct"),
            _fmt(r["final_loss"]),
            _fmt(r["peak_mem_gib"]),
            _fmt(r["predicted_memory_gib"]),
            "[green]ok[/]" if r["status"] == "ok" else f"[red]{r['status']}[/]",
        )
    console = Console(file=file or sys.stdout, width=None if (file or sys.stdout).isatty() else 160)
    console.print(table)
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        console.print(f"[red]{len(failed)} of {len(rows)} sweep points failed:[/]")
        for r in failed:
            console.print(f"  #{r['job']} {r['point']}: {r['error']}", markup=False, highlight=False)


def write_files(rows: list[dict[str, Any]], sweep_dir: Path) -> list[Path]:
    csv_path, json_path = sweep_dir / "sweep_summary.csv", sweep_dir / "sweep_summary.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps(rows, indent=2) + "\n")
    return [csv_path, json_path]


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars of measured tokens/s and MFU per layout, each beside the planner's prediction."""
    done = [r for r in rows if r["tokens_per_s"] is not None]
    if not done:
        return None
    plt = pyplot()
    labels = [f"#{r['job']} {r['layout']}" for r in done]
    x = range(len(done))
    width = 0.38
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 1.4 * len(done) + 4), 4.2))
    for ax, key, title, scale in (
        (axes[0], "tokens_per_s", "tokens/s", 1.0),
        (axes[1], "mfu", "MFU (%)", 100.0),
    ):
        measured = [r[key] * scale for r in done]
        predicted = [(r[f"predicted_{key}"] or 0.0) * scale for r in done]
        ax.bar([i - width / 2 for i in x], measured, width, label="measured", color="#3b7dd8")
        if any(r[f"predicted_{key}"] is not None for r in done):
            ax.bar([i + width / 2 for i in x], predicted, width, label="predicted (planner)", color="#f0a030")
        ax.set_title(title)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    failed = len(rows) - len(done)
    fig.suptitle("sweep: measured vs predicted" + (f" ({failed} failed points not shown)" if failed else ""))
    return save(fig, path)


def plot_losses(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """The loss curves of every point side by side (training loss per step, validation as dots)."""
    curves = [(r["point"] or r["job"], points) for r in rows if (points := read_rows(Path(r["dir"]) / "metrics.jsonl"))]
    if not curves:
        return None
    plt = pyplot()
    moe = any("moe_load_imbalance" in p for _, points in curves for p in points)
    fig, axes = plt.subplots(1, 2 if moe else 1, figsize=(13 if moe else 7.5, 4.2), squeeze=False)
    ax = axes[0][0]
    for label, points in curves:
        loss_lines(ax, points, label)
    if moe:  # a mixture of experts: its load imbalance beside the loss (launcher/model/moe.py)
        side = axes[0][1]
        for label, points in curves:
            side.plot([p["step"] for p in points], [p.get("moe_load_imbalance") for p in points], label=label, lw=1.2)
        side.set_xlabel("step")
        side.set_ylabel("moe_load_imbalance (max / mean tokens per expert)")
        side.grid(alpha=0.3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (dots: validation)")
    ax.set_title("sweep: loss curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def summarize(sweep_dir: Path, file: Any = None) -> list[dict[str, Any]]:
    """Collect, print, and write the summary of a sweep directory; returns the rows."""
    rows = collect(sweep_dir)
    if not rows:
        return rows
    print_table(rows, f"sweep {sweep_dir}", file)
    written = write_files(rows, sweep_dir)
    out = file or sys.stdout
    for note in (batch_note(rows), off_note(rows)):
        if note:
            print(note, file=out)
    charts = []
    if installed("matplotlib"):
        charts = [plot(rows, sweep_dir / "sweep_summary.png"), plot_losses(rows, sweep_dir / "sweep_losses.png")]
    else:  # a minimal install: the table and the files, no charts
        print(f"note: no charts without matplotlib ({install_hint('matplotlib')})", file=out)
    print(f"sweep summary: {', '.join(str(p) for p in [*written, *(c for c in charts if c)])}", file=out)
    return rows


class SweepSummary(Callback):
    """hydra.callbacks.sweep_summary: the summary once every job of the multirun has ended."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            summarize(sweep_dir)
