"""Memoising the planner's pure functions of a layout on the layout fields they read: the search asks
thousands of layouts that differ in their batch split or recompute choice the same per-stage questions.
tests/unit/test_planner_speed.py checks each memoised function reads no field but those it is keyed on. The
keys' other arguments hash cheaply: the machine and its link levels once each (`hash_once`,
hardware/machine.py), the model once per search (`private_model`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, TypeVar

from launcher import flops
from launcher.config.model import ModelConfig

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
MAX_ENTRIES = 100_000  # per function: a long-lived process (a sweep, the tests) starts over past it
MISSING = object()
MAX_MODELS = 64  # `private_model`'s copies kept
_MODELS: dict[ModelConfig, ModelConfig] = {}
MEMOISED: list[Callable[..., Any]] = []  # every function `on_fields` wraps (for the test)

# flops.py's per-token counts for the model (hashable: launcher/config/schema.py), asked for every prediction
flops_per_token = functools.cache(flops.flops_per_token)
hardware_flops_per_token = functools.cache(flops.hardware_flops_per_token)


class _HashedModel(ModelConfig):
    """`private_model`'s copy: a ModelConfig hashed once (a mutable dataclass hashes every field at each call)."""

    def __hash__(self) -> int:
        return self.__dict__["_hash"]


def private_model(m: ModelConfig) -> ModelConfig:
    """A copy of `m` for the search, hashed once: the memoised terms key on the model tens of thousands of times.
    Nothing outside holds the copy, so nothing changes it; it equals only copies like it, and equal models get
    the same copy (a memo key found by identity, its fields not compared)."""
    own = copy.deepcopy(m)
    own.__class__ = _HashedModel
    own.__dict__["_hash"] = hash(m)
    if len(_MODELS) >= MAX_MODELS:
        _MODELS.clear()
    return _MODELS.setdefault(own, own)


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
            value = table.get(key, MISSING)  # one lookup: hashing the key (the model's fields) costs most
            if value is MISSING:
                if len(table) >= MAX_ENTRIES:
                    table.clear()
                value = table[key] = f(*args)
            return value

        memoised.fields = fields  # type: ignore[attr-defined]
        MEMOISED.append(memoised)
        return memoised  # type: ignore[return-value]

    return wrap
