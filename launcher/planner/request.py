"""From a TrainConfig to what the search needs (Problem, Space), validating as it goes.

Every error is a LauncherError whose one line names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os

from launcher.config import LauncherError, TrainConfig
from launcher.planner.layout import Machine
from launcher.planner.machine import machine, worker_threads
from launcher.planner.search import DEGREES, RECOMPUTE, SCHEDULES, Problem, Space


def local_devices(cfg: TrainConfig) -> int:
    """Devices used per node: the profile's, or (cpu) the local worker processes."""
    hw = cfg.hardware
    return min(hw.devices_per_node, cfg.max_local_workers) if hw.kind == "cpu" else hw.devices_per_node


def world_size(cfg: TrainConfig) -> int:
    """Devices to plan for (`nodes` is range-checked by config.check_ranges before any plan)."""
    return cfg.nodes * local_devices(cfg)


def _int_or_auto(key: str, value: object) -> int | None:
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LauncherError(f"{key}={value!r} must be a positive integer or auto")
    return value


def resolve_machine(cfg: TrainConfig, world: int) -> Machine:
    local = min(world, local_devices(cfg))
    threads = worker_threads(cfg.threads, local)
    mach = machine(cfg.hardware, threads, cfg.cache_dir)
    if mach.kind == "cpu":
        # local workers share the cores: with more threads than cores everything time-slices, the
        # matmuls, gloo's copies and reductions, and the framework's dispatch alike
        share = min(1.0, (os.cpu_count() or 1) / (local * threads))
        levels = tuple(lv.time_sliced(share) for lv in mach.levels)
        mach = dataclasses.replace(
            mach, peak_flops=mach.peak_flops * share, levels=levels, host_overhead=mach.host_overhead / share
        )
    return mach


def elem_bytes(cfg: TrainConfig) -> int:
    if cfg.dtype not in ("auto", "fp32", "bf16"):
        raise LauncherError(f"dtype={cfg.dtype!r} is unknown: use auto, fp32 or bf16")
    if cfg.dtype == "auto":
        return 4 if cfg.hardware.kind == "cpu" else 2
    return 4 if cfg.dtype == "fp32" else 2


def problem(cfg: TrainConfig, world: int) -> Problem:
    """The model, sequence and machine to plan for (the keys' ranges are checked by config.check_ranges)."""
    m = cfg.model
    if m.positions == "learned" and cfg.seq_len > m.max_seq_len:
        raise LauncherError(
            f"seq_len={cfg.seq_len} > model.max_seq_len={m.max_seq_len} (learned positions): lower seq_len"
        )
    if world < 1:
        raise LauncherError(f"world size {world} must be positive: set nodes")
    mach = resolve_machine(cfg, world)
    return Problem(model=m, seq=cfg.seq_len, world=world, machine=mach, elem=elem_bytes(cfg))


def space(cfg: TrainConfig, world: int, explore: bool) -> Space:
    """The allowed values of each key; checks that the constrained degrees divide the world."""
    degrees = {k: _int_or_auto(k, getattr(cfg, k)) for k in DEGREES}
    fixed = [degrees[k] for k in ("tp", "pp", "dp") if degrees[k]]
    inner = [degrees[k] for k in ("dp_shard", "dp_replicate") if degrees[k]]
    product = 1
    for d in fixed:
        product *= d
    where = f"nodes x devices = {cfg.nodes} x {local_devices(cfg)} = {world}"
    if world % product:
        given = " x ".join(f"{k}={degrees[k]}" for k in ("tp", "pp", "dp") if degrees[k])
        raise LauncherError(f"{where} is not divisible by {given}: change nodes or those degrees")
    if all(degrees[k] for k in ("tp", "pp", "dp")) and product != world:
        raise LauncherError(f"tp x pp x dp = {product} but {where}: set one of them to auto")
    dp = degrees["dp"]
    for d in inner:
        if dp and dp % d:
            raise LauncherError(f"dp={dp} is not divisible by dp_shard/dp_replicate={d}: change one of them")
        if world % d:
            raise LauncherError(f"{where} is not divisible by dp_shard/dp_replicate={d}: change it")
    m = cfg.model
    tp = degrees["tp"]
    if tp and (m.n_heads % tp or (m.n_kv_heads or m.n_heads) % tp or m.ffn_dim % tp):
        raise LauncherError(
            f"tp={tp} must divide model.n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads or m.n_heads} and "
            f"ffn_dim={m.ffn_dim}: pick a divisor or tp=auto"
        )
    if degrees["pp"] and degrees["pp"] > m.n_layers:
        raise LauncherError(f"pp={degrees['pp']} exceeds model.n_layers={m.n_layers}: lower pp")
    if cfg.sequence_parallel and tp == 1:
        raise LauncherError("sequence_parallel=true needs tp > 1: set tp or sequence_parallel=false")
    batch = cfg.batch if isinstance(cfg.batch, dict) else {}
    micro = _int_or_auto("batch.micro", batch.get("micro", "auto"))
    glob = batch.get("global")
    if cfg.microbatches is not None and (not isinstance(cfg.microbatches, int) or cfg.microbatches < 1):
        raise LauncherError(f"microbatches={cfg.microbatches!r} must be a positive integer or null")
    if cfg.pp_schedule not in (*SCHEDULES, "auto"):
        raise LauncherError(f"pp_schedule={cfg.pp_schedule!r} is unknown: use {', '.join(SCHEDULES)} or auto")
    if cfg.recompute not in (*RECOMPUTE, "auto"):
        raise LauncherError(f"recompute={cfg.recompute!r} is unknown: use {', '.join(RECOMPUTE)} or auto")
    if not isinstance(cfg.virtual_stages, int) or cfg.virtual_stages < 1:
        raise LauncherError(f"virtual_stages={cfg.virtual_stages!r} must be a positive integer")
    schedule = None if cfg.pp_schedule == "auto" else cfg.pp_schedule
    interleaved = schedule == "interleaved_1f1b"
    searched_v = cfg.virtual_stages == 1 and (schedule is None or (explore and interleaved))
    return Space(
        degrees=degrees,
        micro=micro,
        global_batch=glob,
        microbatches=cfg.microbatches,
        schedule=schedule,
        virtual_stages=None if searched_v else cfg.virtual_stages,
        recompute=None if cfg.recompute == "auto" else cfg.recompute,
        sequence_parallel=True if cfg.sequence_parallel else (None if explore else False),
    )
