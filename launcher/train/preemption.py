"""Preemption: SIGTERM or SIGUSR1 (what SLURM sends before preemption or the time limit) asks every
rank to finish its step, save a checkpoint and exit with `PREEMPTED_EXIT` so the job can be requeued."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later", what a requeue is
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Set in local workers started by the elastic agent, which tears a failed group down with SIGTERM:
# there only SIGUSR1 means "save and stop", and SIGTERM keeps its default (die at once).
LOCAL_WORKER_ENV = "LAUNCHER_LOCAL_WORKER"


def agree(value: bool, op: dist.ReduceOp.RedOpType) -> bool:
    """Combine a flag over all ranks (MAX: any rank, MIN: every rank); the flag itself without a group."""
    if not dist.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1 if value else 0], device=device)
    dist.all_reduce(flag, op=op)
    return bool(flag.item())


class PreemptionFlag:
    """Set by a signal handler; `agreed` makes every rank see it at the same step."""

    def __init__(self) -> None:
        self.raised = False
        self.previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGUSR1,) if os.environ.get(LOCAL_WORKER_ENV) else SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.raised = True

    def agreed(self) -> bool:
        return agree(self.raised, dist.ReduceOp.MAX)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
