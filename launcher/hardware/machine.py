"""The machine a layout runs on: the plain data the planner's models read (the layout itself is
`launcher.layout.Layout`).

`Machine` is a hardware profile with every number resolved (FLOP/s, bytes, seconds), link levels
sorted from the innermost (fastest, smallest) to the outermost. No torch here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


KINDS = ("ring", "gather", "scatter", "all_to_all")  # the collectives a level may time differently


def hash_once(cls: type[T]) -> type[T]:
    """A frozen dataclass hashed once per instance (its generated hash reads every field at each call, and the
    memo tables and comm's caches hash the machine and its link levels thousands of times a search)."""
    by_fields = cls.__hash__

    def __hash__(self: Any) -> int:
        if (value := self.__dict__.get("_hash")) is None:
            value = by_fields(self)
            object.__setattr__(self, "_hash", value)
        return value

    cls.__hash__ = __hash__  # type: ignore[method-assign,assignment]
    return cls


@hash_once
@dataclass(frozen=True)
class Level:
    """One interconnect level: `size` devices share a domain; bandwidth per device, one direction."""

    name: str
    size: int
    bandwidth: float | None  # bytes/s per device (None: a one-process machine's links, never used)
    latency: float  # seconds per hop
    gather_bandwidth: float | None = None  # all-gather, when the backend differs; None: bandwidth
    scatter_bandwidth: float | None = None  # reduce-scatter, likewise
    all_to_all_bandwidth: float | None = None  # all-to-all, likewise
    # (bytes, ring, gather, scatter, all-to-all bytes/s) rows by message size, ascending; () : one rate
    by_size: tuple[tuple[float, ...], ...] = ()

    def rate(self, kind: str, nbytes: float | None = None) -> float:
        """Bytes/s of collective `kind` (KINDS) for a buffer of `nbytes` on this level: interpolated in
        log size between the `by_size` rows (the nearest row outside them), else the one rate."""
        if not self.by_size or nbytes is None:
            own = {
                "gather": self.gather_bandwidth,
                "scatter": self.scatter_bandwidth,
                "all_to_all": self.all_to_all_bandwidth,
            }
            return own.get(kind) or self.bandwidth
        col, rows = 1 + KINDS.index(kind), self.by_size
        if nbytes <= rows[0][0] or nbytes >= rows[-1][0]:
            return (rows[0] if nbytes <= rows[0][0] else rows[-1])[col]
        i = bisect.bisect_left([row[0] for row in rows], nbytes)
        lo, hi = rows[i - 1], rows[i]
        return lo[col] * (hi[col] / lo[col]) ** (math.log(nbytes / lo[0]) / math.log(hi[0] / lo[0]))

    def time_sliced(self, share: float) -> Level:
        """This level when each process gets `share` of a core (CPU workers outnumbering the cores):
        the copies and reductions run slower, and a peer answers later."""
        return Level(
            self.name,
            self.size,
            self.bandwidth and self.bandwidth * share,  # None: a one-process machine's, never used
            self.latency / share,
            self.gather_bandwidth and self.gather_bandwidth * share,
            self.scatter_bandwidth and self.scatter_bandwidth * share,
            self.all_to_all_bandwidth and self.all_to_all_bandwidth * share,
            tuple((row[0], *(r * share for r in row[1:])) for row in self.by_size),
        )


@hash_once
@dataclass(frozen=True)
class Machine:
    name: str
    kind: str  # cpu | cuda | tpu
    peak_flops: float  # per device
    memory_bytes: float  # per device
    matmul_efficiency: float
    devices_per_node: int
    levels: tuple[Level, ...]
    host_overhead: float = 0.0  # seconds per tensor-parallel block and microbatch (cpu: DTensor dispatch)
    block_overhead: float = 0.0  # seconds per block and microbatch, fwd + bwd (cpu: the framework's dispatch)
    optimizer_time: float = 0.0  # seconds per parameter a device updates, per step (cpu: fused AdamW)
    memory_bandwidth: float | None = None  # bytes/s of device memory (None: not given, cpu)
    host_copy_time: float = 0.0  # seconds per byte of FSDP's copies around its collectives (cpu)
    flop_per_byte: float = 0.0  # the profile's peak over its memory bandwidth (flops.device_flop_per_byte)
    nonmatmul_width: float = 0.0  # H0 given or calibrated (cpu); 0: from flop_per_byte (planner/efficiency.py)
