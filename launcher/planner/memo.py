"""Memoising the planner's pure functions of a layout on the layout fields they read: the search asks
thousands of layouts that differ in their batch split or recompute choice the same per-stage questions.
tests/test_planner_speed.py checks each memoised function reads no field but those it is keyed on.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, TypeVar

from launcher import flops

F = TypeVar("F", bound=Callable[..., Any])
MAX_ENTRIES = 100_000  # per function: a long-lived process (a sweep, the tests) starts over past it
MEMOISED: list[Callable[..., Any]] = []  # every function `on_fields` wraps (for the test)

# flops.py's per-token counts for the model (hashable: launcher/config.py), asked for every prediction
flops_per_token = functools.cache(flops.flops_per_token)
hardware_flops_per_token = functools.cache(flops.hardware_flops_per_token)


def on_fields(*fields: str) -> Callable[[F], F]:
    """Memoise `f(..., layout, ...)`, every argument hashable and given by position, on its other
    arguments and `fields` of its `layout` (the ones it reads, its callees' too)."""
    read = operator.attrgetter(*fields)

    def wrap(f: F) -> F:
        at = list(inspect.signature(f).parameters).index("layout")
        table: dict[tuple[Any, ...], Any] = {}

        @functools.wraps(f)
        def memoised(*args: Any, **kwargs: Any) -> Any:
            if kwargs or len(args) <= at:
                return f(*args, **kwargs)
            key = (*args[:at], read(args[at]), *args[at + 1 :])
            if key not in table:
                if len(table) >= MAX_ENTRIES:
                    table.clear()
                table[key] = f(*args)
            return table[key]

        memoised.fields = fields  # type: ignore[attr-defined]
        MEMOISED.append(memoised)
        return memoised  # type: ignore[return-value]

    return wrap
