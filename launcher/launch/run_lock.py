"""One run per run directory: an advisory lock (`fcntl`) on RUN_DIR/.lock, held for the run's life.

Taken by a Hydra callback when the run starts, before Hydra writes its own files (.hydra/, the log) into
the directory and before any worker: a second `train` on a live directory (`run_dir` or `hydra.run.dir`
given twice, a resubmitted job) stops in one line naming the holder, and the first run's files stay as
they were. The kernel drops the lock of a process that dies, so a crashed run's directory is free at
once (`resume=auto` continues it); the file's text (host, pid, SLURM job, start) only names the holder.
A SLURM requeue whose earlier incarnation still appears to hold it (a network filesystem's lock outliving
a dead node) is the same job: it proceeds. Under torchrun or SLURM only global rank 0 takes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from launcher.errors import LauncherError
from launcher.files import make_dir

LOCK_NAME = ".lock"


def holder(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def acquire(run_dir: Path, key: str) -> int | None:
    """Lock `run_dir` for this process: the open file descriptor (closing it releases the lock), or None when
    this SLURM job's earlier incarnation holds it (a requeue). One LauncherError when another run holds it."""
    make_dir(run_dir, key)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        other = holder(path)
        job = os.environ.get("SLURM_JOB_ID")
        if job and other.get("slurm_job") == job:
            return None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(other["started"])) if "started" in other else "?"
        raise LauncherError(
            f"{key}={run_dir} is in use by another train (pid {other.get('pid', '?')} on {other.get('host', '?')}, "
            f"since {since}): wait for it to end, or choose another {key}"
        ) from None
    info = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID")}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({**info, "started": time.time()}).encode())
    return fd


def is_rank_zero() -> bool:
    """This process is the run's first (or only) rank: the one that holds the lock."""
    from launcher.launch.rank_env import env_rank

    env = env_rank()
    return env is None or env.rank == 0


class RunDirLock(Callback):
    """hydra.callbacks.run_dir_lock (launcher/conf/train.yaml): the lock for a single run (a multirun's jobs
    each have a directory of their own)."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from launcher.launch.cli import exit_with

        given = config.get("run_dir")
        key = "run_dir" if given else "hydra.run.dir"
        try:
            if is_rank_zero():
                self.fd = acquire(Path(str(given or config.hydra.run.dir)).expanduser(), key)
        except LauncherError as err:  # Hydra turns a callback's exceptions into warnings; an exit it lets through
            exit_with(err)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
