"""Charts as PNG files, drawn by matplotlib (the optional `plot` extra) on the Agg backend: what every chart
shares. A run's loss.png (metrics/charts.py), a sweep's charts (sweep.py), `plan.compare`'s bars and
`plan.calibrate`'s fit (planner/charts.py). No torch here, and matplotlib only once a chart is drawn:
`plan` imports this and stays light."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.config.extras import install_hint, installed
from launcher.files import shown


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: files only, no display, in any process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def chart_line(what: str, draw: Callable[[], Path | None]) -> str | None:
    """Draw one chart (`draw` returns its path, or None where there is nothing to draw) and return the one
    line that says where it went, or why there is none: a note with the install hint without matplotlib, a
    warning with the error where drawing or saving fails. Never raises: a chart does not fail a command."""
    if not installed("matplotlib"):
        return f"note: no {what} without matplotlib ({install_hint('matplotlib')})"
    try:
        path = draw()
    except Exception as err:  # anything matplotlib or the disk raises: one warning line
        return f"warning: no {what} ({type(err).__name__}: {err})"
    return f"{what}: {shown(path)}" if path else None
