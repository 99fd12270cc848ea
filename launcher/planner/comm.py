"""Collective costs on a hierarchy of link levels (ring/tree model with latency).

A process group is `size` ranks spaced `stride` apart in rank order. Ranks fill the innermost level
first (NVLink domain, then the network), so a group splits into factors n_1 x n_2 x ...: n_1 of its
members share one innermost domain, n_2 such domains share the next level, and so on. A collective
runs hierarchically, the way NCCL's rings (one per NIC rail) and trees behave on such machines:
a reduce-scatter moves (n_i - 1)/n_i of the data still unreduced at level i, inner levels first, so
the fast inner links carry most bytes and the network only 1/n_1 of them; an all-gather is its
mirror and an all-reduce is both. Time per level: bytes / (bandwidth per device) + hops x latency,
hops = min(n - 1, 2 ceil(log2 n)) (rings for small groups, trees for large ones). Each level may
give each collective its own bandwidth, and (cpu: gloo, calibrated) that bandwidth by message size:
gloo moves a few MiB at about half the rate of 16 MiB, a cost the per-hop latency does not explain.

Placement assumption: a group fits a domain when its footprint (stride x size) is no larger than
the domain, e.g. 64 of the 72 GPUs of an NVL72 rack; the scheduler places whole groups.
"""

from __future__ import annotations

import math
from functools import cache

from launcher.hardware.machine import Level


def hops(n: int) -> int:
    return 0 if n <= 1 else min(n - 1, 2 * math.ceil(math.log2(n)))


@cache
def split(levels: tuple[Level, ...], stride: int, size: int) -> tuple[tuple[Level, int], ...]:
    """The factors (level, n_i) of a group, innermost first; their product is `size`."""
    out, inside = [], 1
    for i, level in enumerate(levels):
        if i == len(levels) - 1:
            bound = size  # the outermost level holds everything
        else:
            bound = max(1, level.size // stride) if stride <= level.size else 1
        fit = max(d for d in range(inside, size + 1, inside) if size % d == 0 and d <= max(bound, inside))
        if fit > inside:
            out.append((level, fit // inside))
            inside = fit
        if inside == size:
            break
    return tuple(out)


@cache
def _coeffs(levels: tuple[Level, ...], stride: int, size: int, kind: str, nbytes: float | None) -> tuple[float, float]:
    """(seconds per byte of the full buffer, seconds of latency) for a hierarchical reduce-scatter,
    or all-gather, at each level's bandwidth for that `kind` ("ring": the all-reduce's halves) and
    for the bytes still moving at that level (`nbytes` None: levels whose rate has no size)."""
    per_byte, latency, share = 0.0, 0.0, 1.0
    for level, n in split(levels, stride, size):
        per_byte += (n - 1) / n * share / level.rate(kind, None if nbytes is None else nbytes * share)
        latency += hops(n) * level.latency
        share /= n
    return per_byte, latency


def _collective(levels: tuple[Level, ...], nbytes: float, stride: int, size: int, kind: str, units: int = 1) -> float:
    if size <= 1 or nbytes <= 0:
        return 0.0
    # a level calibrated by size reads the rate of one unit's message; else one cache entry for all sizes
    sized = nbytes / units if any(level.by_size for level in levels) else None
    per_byte, latency = _coeffs(levels, stride, size, kind, sized)
    return nbytes * per_byte + latency


def reduce_scatter(levels: tuple[Level, ...], nbytes: float, stride: int, size: int, units: int = 1) -> float:
    """Seconds to reduce-scatter a buffer of `nbytes` (the full, unsharded size) over the group, sent
    as `units` equal collectives one after another (FSDP: one per unit; the rate of that size where
    the level has one, the latency once, as the fits of the accelerator profiles took it)."""
    return _collective(levels, nbytes, stride, size, "scatter", units)


def all_gather(levels: tuple[Level, ...], nbytes: float, stride: int, size: int, units: int = 1) -> float:
    """Seconds to all-gather into a buffer of `nbytes` (the full size): the reduce-scatter mirrored."""
    return _collective(levels, nbytes, stride, size, "gather", units)


def all_reduce(levels: tuple[Level, ...], nbytes: float, stride: int, size: int, units: int = 1) -> float:
    """Seconds to all-reduce `nbytes`: a ring reduce-scatter then a ring all-gather."""
    return 2.0 * _collective(levels, nbytes, stride, size, "ring", units)


def level_of(levels: tuple[Level, ...], footprint: int) -> Level:
    """The innermost level whose domain holds `footprint` consecutive ranks."""
    for level in levels:
        if footprint <= level.size:
            return level
    return levels[-1]


def send(levels: tuple[Level, ...], nbytes: float, distance: int) -> float:
    """Seconds for a point-to-point send between ranks `distance` apart (pipeline neighbours)."""
    if nbytes <= 0:
        return 0.0
    level = level_of(levels, 2 * distance)
    return nbytes / level.bandwidth + level.latency


def all_to_all(levels: tuple[Level, ...], nbytes: float, stride: int, size: int) -> float:
    """Seconds for an all-to-all in which each rank sends `nbytes` in all, an equal share to every
    member: the shares to members behind level i (not inside a smaller domain) cross level i, and
    the levels carry their shares at once, so the slowest level sets the time."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    slowest, latency, inside = 0.0, 0.0, 1
    for level, n in split(levels, stride, size):
        share = (inside * n - inside) / size  # members reached first through this level
        slowest = max(slowest, nbytes * share / level.rate("all_to_all", nbytes))
        latency += hops(n) * level.latency
        inside *= n
    return slowest + latency
