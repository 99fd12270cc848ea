"""A run's loss curve as a PNG (loss.png), drawn by matplotlib (the optional `plot` extra) at the end of a run,
and the metrics.jsonl reading a sweep's loss chart shares with it (launcher/launch/sweep.py); the helpers every chart
shares are launcher/charts.py's. matplotlib is imported only when a chart is drawn, never while a run trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.charts import chart_line, pyplot, save


def read_rows(metrics: Path) -> list[dict[str, Any]]:
    """The logged steps of a metrics.jsonl, the last row of each step (a rolled-back step is logged again),
    in step order; none where the file is missing."""
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return sorted({row["step"]: row for row in rows}.values(), key=lambda row: row["step"])


def loss_lines(ax: Any, rows: list[dict[str, Any]], label: str, val_label: str | None = None) -> None:
    """Training loss per logged step as a line, the validation losses as dots of the line's colour."""
    (line,) = ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, lw=1.2)
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o", color=line.get_color(), ms=4, label=val_label)


def loss_curve(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """One run's loss.png: training loss, validation dots, and a mixture's loss per source, thinner."""
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    loss_lines(ax, rows, "training loss", "validation loss" if any("val_loss" in r for r in rows) else None)
    sources = sorted({key for r in rows for key in r if key.startswith("loss.")})
    for key in sources:  # a mixture (data=mix): each source's loss, launcher/metrics/sources.py
        per = [r for r in rows if key in r]
        ax.plot([r["step"] for r in per], [r[key] for r in per], lw=0.8, alpha=0.7, label=key.replace(".", " ", 1))
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps, not 2.5
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def run_loss_curve(run_dir: Path, title: str) -> str | None:
    """The owner's loss.png from the run's metrics.jsonl; the one line that says where it went, or why
    there is none. Never raises: the run has trained and written its files, a chart does not fail it."""
    return chart_line(
        "loss curve", lambda: loss_curve(read_rows(run_dir / "metrics.jsonl"), run_dir / "loss.png", title)
    )
