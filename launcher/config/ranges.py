"""The values a numeric schema key accepts: `Range`, the field that declares one (`ranged`), and the
check that every key of a config holds its range (`check_ranges`: `validate` runs it on a composed
config, the planner on a hardware profile it loads).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from launcher.errors import LauncherError


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts (None passes where the key's type allows it)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    integer: bool = False
    optional: bool = True
    auto: bool = False  # "auto" passes too: the planner fills it in (batch.micro)

    def holds(self, value: Any) -> bool:
        if isinstance(value, Sequence) and not isinstance(value, str):  # a table: every number in it
            return all(v is not None and self.holds(v) for v in value)
        if value is None or value == "auto":
            return self.optional if value is None else self.auto
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if value != value:  # nan compares false with every bound
            return False
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def __str__(self) -> str:
        bounds = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        text = " and ".join(f"{op} {v}" for op, v in bounds if v is not None)
        return ("an integer " if self.integer else "a value ") + text + (" or auto" if self.auto else "")


def ranged(default: Any, **bounds: Any) -> Any:
    """A schema field whose value must lie in Range(**bounds); `check_ranges` enforces it. An int
    default makes it an integer key; a None default says so with integer=True."""
    return field(default=default, metadata={"range": Range(**{"integer": isinstance(default, int), **bounds})})


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, Range | None]]:
    """Every leaf key of a config (a dataclass instance), its value and its Range (None: unranged)."""
    for f in fields(node):
        key, value = prefix + f.name, getattr(node, f.name)
        if is_dataclass(value):
            yield from leaves(value, key + ".")
        elif isinstance(value, list) and value and is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from leaves(item, f"{key}.{i}.")
        elif "ranges" in f.metadata:  # batch: a dict (see default_batch)
            for sub, rng in f.metadata["ranges"].items():
                yield f"{key}.{sub}", value.get(sub), rng
        else:
            yield key, value, f.metadata.get("range")


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Every value inside the Range its schema field declares: one LauncherError for the first that is not."""
    for key, value, rng in leaves(cfg, prefix):
        if isinstance(value, float) and math.isinf(value):  # no key means "unbounded" by an infinity
            raise LauncherError(f"{key}={value} is not a finite number: use {rng or 'a finite value'}")
        if rng is not None and not rng.holds(value):
            raise LauncherError(f"{key}={value} is out of range: use {rng}")
