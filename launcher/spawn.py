"""Where the ranks run: here (inside torchrun or a SLURM task) or in local workers we start.

"Run here" is read from the environment that torchrun or SLURM sets. Otherwise a world of one runs
in this process (no launch cost), and a larger world starts one local worker per rank through
PyTorch's elastic launch API, which also tears the group down when a worker dies.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.config import TrainConfig
from launcher.layout import Layout, owner_rank
from launcher.train.preemption import LOCAL_WORKER_ENV


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int


def env_rank() -> RankEnv | None:
    """The rank this process already is (torchrun, or one task of a multi-task SLURM step)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        from launcher.slurm import export_rendezvous

        export_rendezvous()  # MASTER_ADDR: first host of the node list; MASTER_PORT: from the job id
        return RankEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return None


def run_rank(cfg: TrainConfig, run_dir: Path, layout: Layout) -> dict[str, Any]:
    """Body of every rank when the world is larger than one: join the group, train, leave."""
    import torch
    import torch.distributed as dist

    from launcher.train.loop import train

    env = env_rank()
    assert env is not None, "run_rank needs RANK/WORLD_SIZE (torchrun, elastic launch) or SLURM variables"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if cfg.hardware.kind == "cuda":
        torch.cuda.set_device(env.local_rank)
    backend = "nccl" if cfg.hardware.kind == "cuda" else "gloo"
    store = None
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # The agent's store outlives a restart: without a per-attempt prefix, a restarted group can
        # read the dead workers' addresses and wait on them forever.
        base, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size))
        store = dist.PrefixStore(f"launcher/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/", base)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size)
    try:
        return train(cfg, run_dir, env.rank, layout)
    finally:
        dist.destroy_process_group()


def start_local_workers(cfg: TrainConfig, run_dir: Path, layout: Layout) -> dict[str, Any]:
    """One process per rank on this machine; returns the summary of the output-owning rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=layout.world_size,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=cfg.max_restarts,  # a restarted group resumes from the newest complete checkpoint
        monitor_interval=0.1,
        start_method="spawn",
    )
    os.environ[LOCAL_WORKER_ENV] = "1"  # inherited by the workers (see launcher/train/preemption.py)
    try:
        results = elastic_launch(config, run_rank)(cfg, run_dir, layout)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise WorkerFailed(f"worker rank {rank} failed (exit {failure.exitcode}): {failure_text(failure)}") from None
    finally:
        os.environ.pop(LOCAL_WORKER_ENV, None)
    return results[owner_rank(layout)]


def failure_text(failure: Any) -> str:
    """One line from elastic's failure record: the exception (`Type: message`) or the signal."""
    message = failure.message
    if isinstance(message, dict):  # a Python exception, recorded with its traceback
        message = message.get("message", "")
    return str(message).strip().splitlines()[-1] if str(message).strip() else "no error message (see its log)"


class WorkerFailed(RuntimeError):
    """A worker died; the message names its rank and error."""


def launch(cfg: TrainConfig, run_dir: Path, layout: Layout) -> dict[str, Any]:
    from launcher.train.loop import train

    if env_rank() is not None:
        return run_rank(cfg, run_dir, layout)
    if layout.world_size == 1:
        return train(cfg, run_dir, 0, layout)
    return start_local_workers(cfg, run_dir, layout)
