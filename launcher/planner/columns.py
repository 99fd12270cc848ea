"""`plan`'s tables as plain text: a header, a rule under it, one line a row, two spaces between columns, every
cell on one line, no trailing spaces. Plain strings, not rich: a log file gets the same bytes as a terminal,
and `plan` answers without importing and measuring a rendering library (tests/integration/test_plan_output.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

GAP = "  "
RULE = "─"


class Columns:
    """A table of string cells; `left`: the headers whose column is left-justified (the rest: right)."""

    def __init__(self, heads: Sequence[str], left: Iterable[str] = ()) -> None:
        self.heads = tuple(heads)
        self.left = frozenset(left)
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        assert len(cells) == len(self.heads), (cells, self.heads)
        self.rows.append(cells)

    def widths(self) -> list[int]:
        return [max(len(cell) for cell in column) for column in zip(self.heads, *self.rows, strict=True)]

    @property
    def width(self) -> int:
        """The columns the table takes, every cell whole."""
        return sum(self.widths()) + len(GAP) * (len(self.heads) - 1)

    def lines(self) -> list[str]:
        widths = self.widths()

        def line(cells: Sequence[str]) -> str:
            return GAP.join(
                cell.ljust(w) if head in self.left else cell.rjust(w)
                for cell, w, head in zip(cells, widths, self.heads, strict=True)
            ).rstrip()

        return [line(self.heads), RULE * self.width, *(line(row) for row in self.rows)]

    def __str__(self) -> str:
        return "\n".join(self.lines()) + "\n"
