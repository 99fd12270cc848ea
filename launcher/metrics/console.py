"""The terminal view: a live rich panel on a terminal, plain lines in logs and CI."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from launcher.metrics.moe_load import LayerLoad, layer_loads, load_table
from launcher.metrics.summary_view import summary_view

COLUMNS = [  # (key, label, format)
    ("step", "step", "{:d}"),
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val loss", "{:.4f}"),
    ("lr", "lr", "{:.2e}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("tflops_per_device", "TFLOP/s/dev", "{:.3f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("mfu_fp8_peak", "MFU fp8 peak", "{:.1%}"),
    ("mem_gib", "mem GiB", "{:.2f}"),
]


SOURCE_KEYS = ("loss.", "val_loss.", "tokens.")  # a mixture's figures per source: loss.web, tokens.web, ...


def shown(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, label) of the row's columns: the fixed ones, then a mixture's per source."""
    return [(k, label) for k, label, _ in COLUMNS if k in row] + [(k, k) for k in row if k.startswith(SOURCE_KEYS)]


def fmt(key: str, value: Any) -> str:
    spec = next((f for k, _, f in COLUMNS if k == key.split(".")[0]), "{}")
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def metrics_table(row: dict[str, Any], title: str | None = None) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    columns = shown(row)
    for _, label in columns:
        table.add_column(label, justify="right")
    table.add_row(*(fmt(k, row[k]) for k, _ in columns))
    return table


class ConsoleView:
    """`rich`: live panel; `plain`: a line every `every` steps; `none`: silent. `moe_table`: under the
    figures (rich), or after the line (plain), a table of each MoE layer's load."""

    def __init__(self, mode: str, total_steps: int, header: str, moe_table: bool = False) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        # a log file or a pipe (every SLURM log): lines as long as they are, never cut at 80 columns
        self.console = Console(soft_wrap=not sys.stdout.isatty())
        self.total = total_steps
        self.every = max(total_steps // 20, 1)
        self.last: dict[str, Any] = {}
        self.moe_table = moe_table
        self.loads: Sequence[LayerLoad] = ()
        self.live: Live | None = None
        if mode != "none":
            self.console.print(header)
        if mode == "rich":
            self.progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task("train", total=total_steps)
            self.live = Live(self._view(), console=self.console, refresh_per_second=4)
            self.live.start()

    def _view(self) -> Group:
        tables = [metrics_table(self.last)] if self.last else []
        if self.moe_table and self.loads:
            tables.append(load_table(self.loads))
        return Group(self.progress, *tables)

    def update(self, row: dict[str, Any], records: Sequence[Mapping[str, Any]] = ()) -> None:
        """A logged step's figures; `records`: its MoE layers' loads (shown with `moe_table`)."""
        self.last.update(row)
        self.loads = loads = layer_loads(records)
        if self.live is not None:
            self.progress.update(self.task, completed=row["step"])
            self.live.update(self._view())
        elif self.mode == "plain" and (row["step"] % self.every == 0 or row["step"] in (1, self.total)):
            print("  ".join(f"{label}={fmt(k, self.last[k])}" for k, label in shown(self.last)), flush=True)
            if self.moe_table and loads:
                self.console.print(load_table(loads))

    def note(self, text: str) -> None:
        if self.mode != "none":  # plain text: `launcher[plot]` or `[[1201,1400]]` is not rich markup
            self.console.print(text, markup=False)

    def close(self, summary: dict[str, Any]) -> None:
        if self.live is not None:
            self.live.stop()
        if self.mode == "none":
            return
        self.console.print(summary_view(summary))
