"""From the layout keys' values to the Layout's numbers: int-or-auto, the world-size rule, the
data-parallel split and the microbatch rule. The planner and `layout_config.from_config` both count
with these.

Batch semantics (docs/parallelism.md): `micro` sequences per microbatch per data-parallel rank,
`microbatches` per step per data-parallel rank (pipeline microbatches, or gradient-accumulation
steps without pipelining), so a step trains `micro x microbatches x dp` sequences (`batch.global`).
"""

from __future__ import annotations

import math
from typing import Any

from launcher.errors import LauncherError


def int_or_auto(key: str, value: Any, auto: str | None = "auto") -> int | None:
    """A positive int, or None where the key says `auto` (`auto=None`: keys whose default is null)."""
    if value == auto:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LauncherError(f"{key}={value!r}: expected a positive integer or {auto or 'null'}")
    return value


def recompute_layers_of(value: Any) -> int | None:
    """`recompute_layers`: a count >= 0, or None for auto (the planner's choice)."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LauncherError(f"recompute_layers={value!r}: expected an integer >= 0 or auto")
    return value


def divisors(n: int) -> list[int]:
    """Every divisor of `n`, ascending: the degrees a dimension of `n` ranks can be split into."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# --- world size ------------------------------------------------------------------------------------------
def check_world(world: int | None, degrees: dict[str, int | None]) -> None:
    """The world-size rule: the given tp x pp x cp x dp equals the world size, or divides it when dp
    (or another degree) is auto; dp_shard and dp_replicate divide dp."""
    given = {k: degrees[k] for k in ("tp", "pp", "cp", "dp") if degrees[k]}
    product = math.prod(given.values())
    complete = len(given) == 4
    if given.get("cp") == 1:  # the default: not worth naming
        del given["cp"]
    names, values = "*".join(given), "*".join(map(str, given.values()))
    if world is not None and complete and product != world:
        raise LauncherError(f"{names}={values}={product} does not match the world size {world}: set dp=auto")
    if world is not None and world % product:
        raise LauncherError(f"world size {world} is not divisible by {names}={values}: change {' or '.join(given)}")
    dp = degrees["dp"]
    if dp is None and world is not None and degrees["tp"] and degrees["pp"] and degrees["cp"]:
        dp = world // (degrees["tp"] * degrees["pp"] * degrees["cp"])
    for key in ("dp_shard", "dp_replicate"):
        if degrees[key] and dp and dp % degrees[key]:
            raise LauncherError(f"{key}={degrees[key]} does not divide dp={dp}: set {key}=auto or change dp")


def split_dp(dp: int, shard: int | None, replicate: int | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for `dp`: what one fixes, the other fills; both auto: all FSDP."""
    if shard is None and replicate is None:
        return 1, dp
    given = f"dp_replicate={replicate or 'auto'} x dp_shard={shard or 'auto'}"
    if shard is None:
        shard = dp // replicate if dp % replicate == 0 else 0
    elif replicate is None:
        replicate = dp // shard if dp % shard == 0 else 0
    if not shard or not replicate or shard * replicate != dp:
        raise LauncherError(f"{given} must equal dp={dp}: set one of them to auto")
    return replicate, shard


def fixed_degrees(degrees: dict[str, int | None], world: int | None, ep: int = 1) -> tuple[int, int, int, int, int]:
    """(tp, pp, cp, dp_replicate, dp_shard) when tp, pp and cp are given: dp takes the ranks that
    remain (when the world size is free: ep, the fewest data-parallel ranks expert parallelism runs on)."""
    check_world(world, degrees)
    tp, pp, cp = degrees["tp"] or 1, degrees["pp"] or 1, degrees["cp"] or 1
    dp = degrees["dp"] or (world // (tp * pp * cp) if world else ep)
    return tp, pp, cp, *split_dp(dp, degrees["dp_shard"], degrees["dp_replicate"])


# --- the batch split -----------------------------------------------------------------------------------
def microbatch_count(micro: int, dp: int, pp: int, global_batch: int | None, microbatches: int | None) -> int:
    """The microbatch rule: per step and data-parallel rank, batch.global / (batch.micro x dp) when
    the global batch is given, else `microbatches`, else 2 x pp with pipelining (a bubble of at most
    a third of the step under 1F1B), else 1 (no accumulation)."""
    if global_batch is None:
        return microbatches or (2 * pp if pp > 1 else 1)
    if global_batch % (micro * dp):
        raise LauncherError(
            f"batch.global={global_batch} is not a multiple of batch.micro x dp = {micro} x {dp}: "
            f"use a multiple of {micro * dp} (e.g. {max(global_batch // (micro * dp), 1) * micro * dp})"
        )
    count = global_batch // (micro * dp)
    if microbatches is not None and microbatches != count:
        raise LauncherError(
            f"microbatches={microbatches} but batch.global / (batch.micro x dp) = {global_batch} / "
            f"({micro} x {dp}) = {count}: set microbatches=null or change batch.global"
        )
    return count
