"""Which rank this process is, and the environment a rank starts with: the variables torchrun or SLURM set
(each checked, one line naming a bad one), the CUDA runtime's defaults and where NCCL's flight recorder
writes. Read before any process group exists (launch/spawn.py)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from launcher.config.layout_keys import check_rank_variables
from launcher.errors import LauncherError


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int


def env_int(name: str, default: int | None = None, least: int = 0) -> int:
    """An integer the launching environment set (torchrun, SLURM): one line naming it when it is not one."""
    raw = os.environ.get(name)
    if raw is None and default is not None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = least - 1
    if value < least:
        raise LauncherError(
            f"{name}={raw!r} from the environment is not an integer >= {least}: fix the launcher or scheduler "
            f"that set it, or unset it to run here"
        )
    return value


def ranks_from(rank: str, world: str, local: str) -> RankEnv:
    """The three variables of one launcher, each checked, and consistent with each other."""
    env = RankEnv(env_int(rank), env_int(world, least=1), env_int(local, default=0))
    if env.rank >= env.world_size or env.local_rank > env.rank:
        raise LauncherError(
            f"{rank}={env.rank}, {world}={env.world_size} and {local}={env.local_rank} from the environment do not "
            f"fit together ({rank} < {world}, {local} <= {rank}): fix the launcher that set them, or unset them"
        )
    return env


def env_rank() -> RankEnv | None:
    """The rank this process already is (torchrun, or one task of a multi-task SLURM step)."""
    env = os.environ
    check_rank_variables(env)  # one of them alone: one line, not a run here with the others ignored
    if "RANK" in env:
        return ranks_from("RANK", "WORLD_SIZE", "LOCAL_RANK")
    # a task beyond the first needs a task count above it (SLURM_NTASKS unset: 1)
    if "SLURM_PROCID" in env and (env_int("SLURM_NTASKS", default=1, least=1) > 1 or env_int("SLURM_PROCID") > 0):
        ranks = ranks_from("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        from launcher.launch.slurm_job import export_rendezvous

        export_rendezvous()  # MASTER_ADDR: first host of the node list; MASTER_PORT: from the job id
        return ranks
    return None


# Each setting under every name torch reads it by, the current one first (older torch reads the later ones):
# a value the user gave under any of them is kept, and ours goes under all of them.
CUDA_ENV = {
    # a NCCL error or timeout tears the process down (the agent or the scheduler sees a failed rank)
    # instead of leaving it blocked in a collective
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING",): "1",
    # the allocator grows segments in place: less fragmentation as activation sizes vary
    ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"): "expandable_segments:True",
    # NCCL's flight recorder keeps each group's last 2000 collectives and dumps them when one times out
    # or fails, so that a hang leaves a trace of who waited on what (where: `flight_recorder_env`)
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",
    ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
}
FLIGHT_RECORDER_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # + the rank: one file each


def set_defaults(settings: dict[tuple[str, ...], str], environ: MutableMapping[str, str]) -> None:
    for names, value in settings.items():
        if not any(name in environ for name in names):
            environ.update(dict.fromkeys(names, value))


def cuda_env_defaults(kind: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """The CUDA runtime settings a run starts with, unless the user set them; nothing off cuda. Read
    when the CUDA allocator and NCCL start, so this runs before either (workers inherit it)."""
    if kind == "cuda":
        set_defaults(CUDA_ENV, environ)


def flight_recorder_env(run_dir: Path, environ: MutableMapping[str, str] = os.environ) -> None:
    """The flight recorder's dumps under the run directory (`flight_recorder/rank_N`), unless the user
    chose a place: torch's default, /tmp on the node, is often cleared when the job ends."""
    if not any(name in environ for name in FLIGHT_RECORDER_FILE):
        folder = run_dir / "flight_recorder"
        folder.mkdir(parents=True, exist_ok=True)
        set_defaults({FLIGHT_RECORDER_FILE: str(folder / "rank_")}, environ)


def local_device(local_rank: int) -> int:
    """This rank's GPU among those it sees: its local rank modulo their number. torchrun, and SLURM tasks
    that see the whole node, see every GPU; a SLURM site that binds one GPU per task shows each task
    only its own (device 0), whatever its SLURM_LOCALID."""
    import torch

    return local_rank % max(1, torch.cuda.device_count())
