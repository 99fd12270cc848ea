"""Preemption: SIGINT (Ctrl-C), SIGTERM or SIGUSR1 (what SLURM sends before preemption or the time limit)
asks every rank to finish its step, save a checkpoint and exit with `PREEMPTED` (launcher/errors.py) so
the job can be requeued or rerun; a second Ctrl-C stops at once (`KeyboardInterrupt`, which the CLI turns
into exit `INTERRUPTED`). Local workers get the request from their launcher (see launcher/launch/spawn.py)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# Set in local workers started by the elastic agent, which tears a failed group down with SIGTERM:
# there only SIGUSR1 (forwarded by the launcher) means "save and stop", SIGTERM keeps its default (die
# at once) and SIGINT is ignored, as a terminal's Ctrl-C reaches the launcher too, which forwards it.
LOCAL_WORKER_ENV = "LAUNCHER_LOCAL_WORKER"


def local_worker_signals() -> None:
    """Local workers are born with the stop signals blocked (spawn.py): ignore Ctrl-C and let SIGTERM kill
    again. SIGUSR1 stays blocked until `PreemptionFlag` handles it, so that one sent early waits instead of
    killing; outside the loop it does nothing (a request that comes after the last step is moot)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def collective_device() -> torch.device:
    """Where a small tensor for a collective of the default group lives: NCCL needs this rank's GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def agree(value: bool, op: dist.ReduceOp.RedOpType) -> bool:
    """Combine a flag over all ranks (MAX: any rank, MIN: every rank); the flag itself without a group."""
    if not dist.is_initialized():
        return value
    flag = torch.tensor([1 if value else 0], device=collective_device())
    dist.all_reduce(flag, op=op)
    return bool(flag.item())


class PreemptionFlag:
    """Set by a signal handler; the loop gathers every rank's `raised` each step (with its memory figure),
    so that all ranks stop at the same step. Once it is set, a Ctrl-C raises `KeyboardInterrupt` (stop at
    once) after giving the signals back to their old handlers."""

    def __init__(self, signals: tuple[signal.Signals, ...] | None = None) -> None:
        self.raised = False
        self.previous: dict[int, object] = {}
        if signals is None:
            signals = (signal.SIGUSR1,) if os.environ.get(LOCAL_WORKER_ENV) else STOP_SIGNALS
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self.previous[sig] = signal.signal(sig, self._handle)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # one that came before us is handled now

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.raised:
            self.restore()
            raise KeyboardInterrupt
        self.raised = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
