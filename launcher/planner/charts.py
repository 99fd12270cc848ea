"""`plan`'s charts (launcher/charts.py draws them: matplotlib only where installed, imported only here, when
one is drawn). `plan.compare`: the days and the cost of `plan.tokens` on each profile, as bars, where
`plan.chart=PATH` asks (plain `plan` writes nothing where it runs). `plan.calibrate`: each run's predicted
step time against its measured one before and after the fit, at `plan.chart` or beside the calibrated profile
(`plan.calibrate_out`/NAME_calibration.png). One line says where a chart went, or why there is none."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from launcher.charts import chart_line, pyplot, save
from launcher.errors import LauncherError
from launcher.planner.budget import Row
from launcher.planner.report import compare_title, fmt_rate

FORMATS = (".png", ".svg", ".pdf")  # what matplotlib writes by the file's name
BAR, BEST = "tab:blue", "tab:green"


def chart_path(chart: str | None, compare: bool, calibrate: bool) -> Path | None:
    """plan.chart checked before any search or fit: a file matplotlib writes, for a command that draws one."""
    if chart is None:
        return None
    if Path(chart).suffix.lower() not in FORMATS:
        raise LauncherError(f"plan.chart={chart}: name a .png file (or .svg, .pdf), e.g. plan.chart=plan_compare.png")
    if not (compare or calibrate):
        raise LauncherError(
            "plan.chart draws plan.compare's bars or plan.calibrate's fit: give plan.compare=[A,B] with "
            "plan.tokens=N, or plan.calibrate=DIR, or drop plan.chart"
        )
    return Path(chart)


def say(line: str | None, out: TextIO | None = None) -> None:
    """The chart's line, where there is one: under the tables, or on stderr beside JSON."""
    if line:
        print(line, file=out or sys.stdout)


def compare_line(rows: Sequence[Row], tokens: float, what: str, path: Path) -> str | None:
    return chart_line("plan.compare chart", lambda: compare_chart(rows, compare_title(tokens, what), path))


def calibration_line(runs: Sequence[dict[str, Any]], title: str, path: Path) -> str | None:
    return chart_line("calibration chart", lambda: calibration_chart(runs, title, path))


def bar_values(rows: Sequence[Row]) -> dict[str, list[tuple[float | None, str]]]:
    """Per panel, each profile's bar and its text: the days, the cost in USD; a word where there is no bar."""
    days, cost = [], []
    for row in rows:
        b = row.budget
        if b is None or b.goodput <= 0:  # no layout fits, or failures outpace restarts
            word = "none fits" if b is None else "never"
            days.append((None, word))
            cost.append((None, word))
            continue
        days.append((b.days, f"{b.days:,.1f}"))
        cost.append((None, "no price") if b.cost is None else (b.cost, f"${fmt_rate(b.cost)}"))
    return {"days": days, "cost, USD (hardware.price_per_hour)": cost}


def compare_chart(rows: Sequence[Row], title: str, path: Path) -> Path:
    """`plan.compare` as horizontal bars, a profile a row (its devices under its name), in the table's
    order: the days `plan.tokens` takes beside what they cost, the least of each in green."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.4 + 0.55 * len(rows)), sharey=True)
    where = list(range(len(rows)))
    for ax, (name, bars) in zip(axes, bar_values(rows).items()):
        values = [v for v, _ in bars if v is not None]
        least = min(values, default=None)
        ax.barh(where, [v or 0 for v, _ in bars], color=[BEST if v == least else BAR for v, _ in bars], height=0.6)
        for y, (v, text) in zip(where, bars):
            ax.text(v or 0, y, f" {text}", va="center", fontsize=8)
        ax.set_xlim(0, max(values, default=1) * 1.3)  # room for the text beside the longest bar
        ax.set_xlabel(name)
        ax.grid(axis="x", alpha=0.3)
    axes[1].xaxis.set_major_formatter(lambda x, _: f"${fmt_rate(x)}")  # $50M, not 0.5 under 1e8
    axes[0].set_yticks(where, [f"{r.hardware.name}\n{r.devices:,} devices" for r in rows], fontsize=8)
    axes[0].invert_yaxis()  # the first profile on top, as in the table
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(fig, path)


def calibration_chart(runs: Sequence[dict[str, Any]], title: str, path: Path) -> Path:
    """`plan.calibrate`'s runs (calibrate.result_rows): predicted step time against measured on log axes,
    before the fit (hollow, grey) and after (filled), joined by a thin line; held-out runs as triangles.
    On the dashed y = x line a prediction is exact."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 6))
    for held, marker, color, name in ((False, "o", "tab:blue", "fitted"), (True, "^", "tab:orange", "held out")):
        part = [r for r in runs if r["held_out"] == held]
        if not part:
            continue
        measured = [r["measured_s"] for r in part]
        for r in part:
            ax.plot([r["measured_s"]] * 2, [r["before_s"], r["after_s"]], color="0.75", lw=0.8, zorder=1)
        ax.scatter(measured, [r["before_s"] for r in part], marker=marker, facecolors="none", edgecolors="0.5",
                   label=f"{name}, before", zorder=2)  # fmt: skip
        ax.scatter(measured, [r["after_s"] for r in part], marker=marker, color=color, label=f"{name}, after",
                   zorder=3)  # fmt: skip
    seen = [r[key] for r in runs for key in ("measured_s", "before_s", "after_s")]
    lo, hi = min(seen) / 1.3, max(seen) * 1.3
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured", zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("measured step time, s")
    ax.set_ylabel("predicted step time, s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(fig, path)
