"""The Layout a config asks for: the degrees it gives, the world size it plans for or the launch
imposes, the Layout it fixes completely, and whether this machine can start that layout's workers.
The layout package itself never reads a TrainConfig; this is where its keys are read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from launcher.config.schema import TrainConfig
from launcher.errors import LauncherError
from launcher.layout import (
    DEGREES,
    SCHEDULE,
    Layout,
    check,
    fixed_degrees,
    int_or_auto,
    microbatch_count,
    recompute_layers_of,
    workers_per_node,
)


def given_degrees(cfg: TrainConfig) -> dict[str, int | None]:
    """The parallel degrees the config fixes (None: auto)."""
    return {key: int_or_auto(key, getattr(cfg, key)) for key in DEGREES}


def local_devices(cfg: TrainConfig) -> int:
    """Devices per node to plan for: the profile's, or (cpu) as many local workers as may start."""
    hw = cfg.hardware
    return min(hw.devices_per_node, cfg.max_local_workers) if hw.kind == "cpu" else hw.devices_per_node


def plan_world_size(cfg: TrainConfig) -> int:
    """The devices `plan` (and the layout sweeper) plan for: nodes x devices per node (`nodes` is
    range-checked by validate.validate first)."""
    return cfg.nodes * local_devices(cfg)


def launch_world_size(cfg: TrainConfig, env_world_size: int | None) -> int | None:
    """The world size the launch imposes, if any: the environment's (torchrun, SLURM), else
    nodes x devices_per_node on a GPU profile; None on the cpu profile (the degrees decide)."""
    if env_world_size is not None:
        return env_world_size
    if cfg.hardware.kind == "cuda":
        return cfg.nodes * cfg.hardware.devices_per_node
    return None


def from_config(cfg: TrainConfig, world: int | None) -> Layout:
    """The layout a config fixes completely (no `auto` but the dp degrees), checked."""
    batch = cfg.batch
    degrees = given_degrees(cfg)
    ep = degrees["ep"] or 1
    tp, pp, cp, replicate, shard = fixed_degrees(degrees, world, ep)
    micro = int_or_auto("batch.micro", batch.get("micro"))
    if micro is None:
        raise LauncherError("batch.micro=auto is the planner's choice: give a world size or a value")
    global_batch = int_or_auto("batch.global", batch.get("global"), auto=None)
    count = microbatch_count(
        micro, replicate * shard, pp, global_batch, int_or_auto("microbatches", cfg.microbatches, None)
    )
    v = int_or_auto("virtual_stages", cfg.virtual_stages, auto=None) or 1
    row = SCHEDULE.get(cfg.pp_schedule)
    if row and row.virtual and v == 1:  # the default: the schedule's own count (a V is two stages per rank)
        v = row.virtual
    layers = recompute_layers_of(cfg.recompute_layers)
    if layers is None:
        raise LauncherError("recompute_layers=auto is the planner's choice: give a world size or a value")
    sp, reshard = bool(cfg.sequence_parallel), cfg.fsdp.reshard_after_forward
    lay = Layout(tp, pp, replicate, shard, micro, count, cfg.pp_schedule, v, cfg.recompute, sp, layers, reshard, cp, ep)
    check(lay, cfg.model, cfg.seq_len)
    if lay.zero_bubble and cfg.compile is True:
        raise LauncherError(
            f"pp_schedule={lay.schedule} splits the backward into input and weight gradients, which torch.compile'd "
            "stages do not support: set compile=false (compile=auto leaves these stages eager)"
        )
    return lay


def check_environment(cfg: TrainConfig, layout: Layout, local: bool, here: bool = True) -> None:
    """What this machine must offer to start the layout's workers here (`local`: not torchrun/SLURM);
    `here=False`: they start elsewhere (slurm.emit writes a script on a login node, often GPU-less)."""
    per_node = workers_per_node(layout.world_size, cfg.nodes)
    if local and per_node > cfg.max_local_workers and cfg.hardware.kind == "cpu":
        raise LauncherError(
            f"layout needs {layout.world_size} local workers, more than max_local_workers={cfg.max_local_workers} "
            f"({os.cpu_count()} CPU cores here): lower tp/pp/dp, or raise max_local_workers"
        )
    if cfg.hardware.kind not in ("cpu", "cuda"):  # a profile to plan with (tpu): nothing here runs on it
        raise LauncherError(
            f"hardware={cfg.hardware.name} is a planner-only profile (kind {cfg.hardware.kind}): `train` runs on "
            f"CPUs and CUDA GPUs: use `plan` with it, or dry_run=true to only check the layout"
        )
    if cfg.hardware.kind == "cuda" and here:
        import torch

        if not torch.cuda.is_available():
            raise LauncherError(
                f"hardware={cfg.hardware.name} is a GPU profile but no CUDA device is visible: "
                f"use hardware=cpu, or dry_run=true to only check the layout"
            )
        if local and torch.cuda.device_count() < per_node:
            raise LauncherError(
                f"{per_node} workers per node need {per_node} GPUs, found {torch.cuda.device_count()}: "
                f"set hardware.devices_per_node={torch.cuda.device_count()} or lower tp/pp/dp"
            )


TORCHRUN = ("RANK", "WORLD_SIZE")  # torchrun sets them together; LOCAL_RANK and LOCAL_WORLD_SIZE only with them


def check_rank_variables(env: Mapping[str, str]) -> None:
    """A rank's variables half set (RANK without WORLD_SIZE, LOCAL_RANK alone, a SLURM task beyond the first
    without a task count): one line, not a run here with the stray one ignored."""
    given = [name for name in (*TORCHRUN, "LOCAL_RANK", "LOCAL_WORLD_SIZE") if name in env]
    missing = [name for name in TORCHRUN if name not in env]
    if given and missing:
        raise LauncherError(
            f"{given[0]} is set but {missing[0]} is not: a rank needs both RANK and WORLD_SIZE (torchrun sets them "
            f"together), or none of {', '.join(given)} to run here"
        )
    if env.get("SLURM_PROCID", "0").strip() != "0" and "SLURM_NTASKS" not in env:  # the first task may run alone
        raise LauncherError(
            f"SLURM_PROCID={env['SLURM_PROCID']} is set but SLURM_NTASKS is not: a task needs both (srun sets them "
            "together), or neither to run here"
        )


def rendezvous_variables(env: MutableMapping[str, str]) -> None:
    """Where a rank started by torchrun (or by hand) meets the others: MASTER_PORT must be given (SLURM's
    tasks derive it, launcher/launch/slurm_job.py); MASTER_ADDR defaults to this host."""
    if "MASTER_PORT" not in env:
        raise LauncherError(
            "RANK and WORLD_SIZE are set but MASTER_PORT is not: the ranks meet at MASTER_ADDR:MASTER_PORT "
            "(torchrun sets both): export MASTER_PORT=29500 (and MASTER_ADDR, rank 0's host) on every rank, or "
            "unset RANK and WORLD_SIZE to run here"
        )
    env.setdefault("MASTER_ADDR", "127.0.0.1")
