"""The layout planner: predict memory, step time and MFU of every layout, pick the best, refuse what
cannot fit. Pure Python: nothing here imports torch unless a profile needs calibrating (cpu).

- `run_plan(cfg)`: the `plan` command (ranked table, or JSON with plan.format=json).
- `best_layout(cfg, world_size)`: a copy of cfg with every `auto` filled by the best layout.
- `check(cfg, world_size)`: the prediction for a resolved layout; refuses one that cannot fit.

Modules: layout (data), machine (profile -> numbers), comm (collectives on link levels), memory,
cost (step time), search (enumerate + rank), request (config -> search space), report (output).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from launcher.config import LauncherError, TrainConfig, check_ranges
from launcher.layout import divisors
from launcher.planner.layout import GIB, Layout
from launcher.planner.report import to_json, to_table
from launcher.planner.request import problem, space, world_size
from launcher.planner.search import DEGREES, Prediction, Problem, Result, Space, predict, search

__all__ = ["run_plan", "best_layout", "check", "plan", "Prediction", "Layout"]


def plan(cfg: TrainConfig, world: int, explore: bool = False) -> tuple[Problem, Result]:
    """Search every layout `cfg` allows on `world` devices; raise if none is valid."""
    prob = problem(cfg, world)
    sp = space(cfg, world, explore)
    res = search(prob, sp)
    if not res.ranked:
        raise _no_layout(cfg, prob, sp, res)
    return prob, res


def run_plan(cfg: TrainConfig) -> None:
    if cfg.plan.format not in ("table", "json"):
        raise LauncherError(f"plan.format={cfg.plan.format!r} is unknown: use table or json")
    check_ranges(cfg)  # the same ranges `train` refuses
    world = world_size(cfg)
    prob, res = plan(cfg, world, explore=cfg.plan.explore)
    shown = res.ranked[: cfg.plan.top] if cfg.plan.top else res.ranked
    if cfg.plan.format == "json":
        to_json(shown)
        return
    glob = cfg.batch.get("global") if isinstance(cfg.batch, dict) else None
    title = (
        f"{cfg.model.name} on {world} x {prob.machine.name} ({cfg.nodes} nodes), seq_len {prob.seq}, "
        f"global batch {glob if glob else 'micro x dp x m'}: {len(res.ranked)} layouts fit "
        f"(of {res.tried}), best {len(shown)} by tokens/s"
    )
    to_table(shown, title)


def best_layout(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """A copy of `cfg` with each `auto` filled from the fastest layout that fits `world_size` devices.

    Filled: tp, pp, dp, dp_shard, dp_replicate, batch.micro, pp_schedule and recompute when `auto`;
    virtual_stages when the schedule was auto; microbatches when None and pp > 1 (the planned count,
    global / (micro dp), or 2 pp without batch.global). Everything else is kept as given.
    """
    _, res = plan(cfg, world_size, explore=False)
    lay = res.ranked[0].layout
    changes: dict[str, Any] = {k: getattr(lay, k) for k in DEGREES if getattr(cfg, k) == "auto"}
    batch = dict(cfg.batch)
    if batch.get("micro", "auto") == "auto":
        batch["micro"] = lay.micro
    changes["batch"] = batch
    if cfg.pp_schedule == "auto":
        changes["pp_schedule"] = lay.schedule
        changes["virtual_stages"] = lay.chunks
    if cfg.recompute == "auto":
        changes["recompute"] = lay.recompute
    if cfg.microbatches is None and lay.pp > 1:
        changes["microbatches"] = lay.microbatches
    return dataclasses.replace(cfg, **changes)


def layout_of(cfg: TrainConfig, world: int) -> Layout:
    """The Layout a fully resolved config describes (runtime semantics)."""
    for key in (*DEGREES, "pp_schedule", "recompute"):
        if getattr(cfg, key) == "auto":
            raise LauncherError(f"{key}=auto: resolve the layout first (planner.best_layout) or give a value")
    sp = space(cfg, world, explore=False)
    tp, pp, dp = cfg.tp, cfg.pp, cfg.dp
    if tp * pp * dp != world:
        raise LauncherError(f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp} but the world is {world}")
    if cfg.dp_shard * cfg.dp_replicate != dp:
        raise LauncherError(f"dp_shard x dp_replicate = {cfg.dp_shard} x {cfg.dp_replicate} must be dp={dp}")
    micro = sp.micro
    if micro is None:
        raise LauncherError("batch.micro=auto: resolve the layout first (best_layout) or give a value")
    if sp.global_batch is None:
        mb = cfg.microbatches or (2 * pp if pp > 1 else 1)
    else:
        if sp.global_batch % (micro * dp):
            raise LauncherError(
                f"batch.global={sp.global_batch} is not divisible by batch.micro x dp = {micro} x {dp}: "
                "change one of them"
            )
        mb = sp.global_batch // (micro * dp)
        if cfg.microbatches is not None and pp > 1 and cfg.microbatches != mb:
            raise LauncherError(
                f"microbatches={cfg.microbatches} but batch.global / (batch.micro x dp) = {mb}: set one"
            )
    return Layout(
        tp,
        pp,
        cfg.dp_shard,
        cfg.dp_replicate,
        micro,
        mb,
        cfg.pp_schedule,
        cfg.virtual_stages,
        cfg.recompute,
        bool(cfg.sequence_parallel),
    )


def check(cfg: TrainConfig, world_size: int) -> dict:
    """Predict memory, step time, tokens/s and MFU for cfg's resolved layout (a JSON-able dict).

    Raises LauncherError, with the numbers, when the predicted memory exceeds hardware.memory_gib
    (unless force=true). Per-component predictions: `memory` (GiB) and `time_s` (seconds).
    """
    lay = layout_of(cfg, world_size)
    prob = problem(cfg, world_size)
    pred = predict(prob, lay)
    if not pred.fits and not cfg.force:
        mem = pred.memory.as_gib()
        raise LauncherError(
            f"predicted {mem['total']:.1f} GiB per device (params+grads+optimizer "
            f"{mem['params'] + mem['grads'] + mem['optimizer']:.1f}, activations {mem['activations']:.1f}) "
            f"exceeds hardware.memory_gib={cfg.hardware.memory_gib}: use recompute=full, a smaller "
            "batch.micro, more tp/pp/dp_shard, or force=true"
        )
    return pred.as_dict()


def _no_layout(cfg: TrainConfig, prob: Problem, sp: Space, res: Result) -> LauncherError:
    if res.smallest is not None:
        s, lay = res.smallest, res.smallest.layout
        return LauncherError(
            f"model {cfg.model.name} fits no layout on {prob.world} x {prob.machine.name}: the smallest "
            f"needs {s.memory.total / GIB:.1f} GiB per device (tp={lay.tp} pp={lay.pp} dp={lay.dp} "
            f"{lay.sharding} micro={lay.micro} recompute={lay.recompute}) but hardware.memory_gib="
            f"{cfg.hardware.memory_gib}: add nodes, lower seq_len or batch.micro, or a bigger profile"
        )
    if sp.global_batch is not None:
        dps = sorted({prob.world // d for d in divisors(prob.world)})
        if sp.degrees["dp"]:
            dps = [sp.degrees["dp"]]
        shown = ", ".join(map(str, dps[:8])) + ("..." if len(dps) > 8 else "")
        multiple = dps[-1] if sp.degrees["dp"] else prob.world
        hint = " or pp_schedule=auto" if sp.schedule == "interleaved_1f1b" else ""
        return LauncherError(
            f"batch.global={sp.global_batch} cannot be split: it must be a multiple of batch.micro x dp x "
            f"microbatches for some layout of {prob.world} devices (possible dp: {shown}): use a multiple "
            f"of {multiple}{hint}"
        )
    return LauncherError(
        f"no layout of {prob.world} devices satisfies tp/pp/dp/dp_shard/dp_replicate, pp_schedule and "
        f"sequence_parallel as given for model {cfg.model.name}: set some of them to auto"
    )
