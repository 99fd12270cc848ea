"""Checkpoint writes that fail loudly and safely: the free-space check before a save, the cause of a
failed save in one line, and what each save cost (seconds, bytes per rank).

Before DCP writes, its global plan says how many bytes every rank will write (replicated tensors once):
when the checkpoint root has less free space, rank 0 prints one warning line; the save is still tried.
A failed save is named by the OSError found in the exception's chain or in DCP's per-rank failures
(ENOSPC: "no space left on device"). torch's zip writer reports a full disk as "unexpected pos N vs M",
with no errno: when no errno is found and the root has less free space than this rank's shards, the
cause reads "disk full? X MiB free on DIR".

Tests inject a full disk through `LAUNCHER_TEST_DISK_FULL=STEP[:RANK]` (launcher/train/faults.py): that
rank's shard writes at that step raise OSError(ENOSPC).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import statistics
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from launcher.errors import LauncherError
from launcher.train.faults import fault_plan
from launcher.train.preemption import agree, collective_device

log = logging.getLogger("launcher")
MIB = 2**20
CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}


def state_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in a (nested) state dict; a DTensor's local shard only."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def free_bytes(root: Path) -> int:
    return shutil.disk_usage(root).free


class SizedPlanner(DefaultSavePlanner):
    """DCP's save planner that also sums what the global plan writes, and warns (rank 0, one line) when
    that does not fit in the checkpoint root's free space."""

    def __init__(self, root: Path, step: int) -> None:
        super().__init__()
        self.root, self.step = root, step

    def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
        plans, metadata = super().create_global_plan(all_plans)
        needed = sum(chunk_bytes(item.tensor_data) for plan in plans for item in plan.items if item.tensor_data)
        free = free_bytes(self.root)
        if needed > free:
            line = (
                f"checkpoint at step {self.step} needs {needed / MIB:.2f} MiB but {self.root} has "
                f"{free / MIB:.2f} MiB free: it will likely fail; free space or set checkpoint.dir"
            )
            log.warning(line)
            print(f"warning: {line}", flush=True)
        return plans, metadata


def chunk_bytes(data: Any) -> int:
    """Bytes of one planned tensor write: its chunk (WriteItem.tensor_storage_size counts the whole tensor)."""
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


class FullDisk(FileSystemWriter):
    """Tests only (LAUNCHER_TEST_DISK_FULL): DCP's file writer whose shard writes find the disk full."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


def storage_writer(path: Path, step: int, rank: int) -> FileSystemWriter:
    """DCP's file writer for `path`; at the step and rank the test fault plan names (LAUNCHER_TEST_DISK_FULL),
    one that fails as a full disk does."""
    return FullDisk(str(path)) if fault_plan().disk_full_at(step, rank) else FileSystemWriter(str(path))


def _errors(err: BaseException) -> list[tuple[BaseException, int]]:
    """`err` and what caused it (its chain; for DCP's CheckpointException each rank's failure), each with
    the rank it happened on (0: this one's, or rank 0's)."""
    found: list[tuple[BaseException, int]] = []
    todo: list[tuple[BaseException | None, int]] = [(err, 0)]
    seen: set[int] = set()
    while todo:
        e, rank = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append((e, rank))
        todo += [(e.__cause__, rank), (e.__context__, rank)]
        if isinstance(e, CheckpointException):
            todo += [(f[0] if isinstance(f, tuple) else f, r) for r, f in e.failures.items()]
    return found


def cause(err: BaseException, root: Path, rank_bytes: int) -> str:
    """One line saying why a save failed: the errno's words (and the file), else "disk full?" when the
    root has less free space than this rank's shards need, else the innermost error's first line; with
    the rank it happened on when DCP reports another rank's failure."""
    errors = _errors(err)
    for e, rank in errors:
        if isinstance(e, OSError) and e.errno:
            words = CAUSES.get(e.errno, e.strerror or errno.errorcode.get(e.errno, str(e.errno)))
            return (f"{words} ({e.filename})" if e.filename else words) + (f" (rank {rank})" if rank else "")
    free = free_bytes(root) if root.exists() else 0
    inner, rank = errors[-1]
    text = next((line for line in str(inner).splitlines() if line.strip()), "")[:200]
    what = (f"{type(inner).__name__}: {text}" if text else type(inner).__name__) + (f" (rank {rank})" if rank else "")
    if free < rank_bytes:
        return f"disk full? {free / MIB:.2f} MiB free on {root} ({what})"
    return what


def barrier() -> None:
    if dist.is_initialized():  # NCCL: on this rank's GPU, not one torch guesses from the rank
        device = collective_device()
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def first_error(error: str) -> str:
    """The first rank's error, on every rank ("" when every rank succeeded): ranks must agree that a save
    failed (or a checkpoint failed to load) before their next collective."""
    if not dist.is_initialized() or agree(not error, dist.ReduceOp.MIN):
        return error
    errors: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"{e} (rank {r})" if r else e for r, e in enumerate(errors) if e), "")


def prepare(partial: Path, rank: int, rng: dict[str, torch.Tensor], root: Path, nbytes: int) -> str:
    """Rank 0 makes the partial folder, then every rank writes its RNG states (file prefix: state)
    there; why that failed on the first rank that failed, on every rank, or ""."""
    error = ""
    if rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as err:
            error = cause(err, root, nbytes)
    barrier()
    try:
        for prefix, state in rng.items():
            torch.save(state, partial / f"{prefix}rank{rank}.pt")
    except (OSError, RuntimeError) as err:  # torch's zip writer: RuntimeError on a full disk
        error = error or cause(err, root, nbytes)
    return first_error(error)


def commit(partial: Path, done: Path, files: dict[str, str], rank: int, root: Path, nbytes: int) -> str:
    """Every rank's shards are on disk: rank 0 writes `files` (name: text, the marker last) and renames
    the folder to `done`; why that failed, on every rank, or ""."""
    error = ""
    if rank == 0:
        try:
            for name, text in files.items():
                (partial / name).write_text(text)
            if done.exists():  # an older run's checkpoint of this step (superseded by this one)
                shutil.rmtree(done)
            partial.rename(done)
        except OSError as err:
            error = cause(err, root, nbytes)
    return first_error(error)


@dataclass
class Pending:
    """An async save in flight: the checkpointer's `wait` completes it, or reports its failure."""

    future: Future
    partial: Path
    done: Path
    st: Any  # checkpoint.Stateful
    final: bool  # its failure stops the run
    nbytes: int
    seconds: float  # what training waited for it


class SaveStats:
    """This rank's completed saves for the summary: the seconds of each, and the bytes of the last (the
    checkpoint's size on this rank)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.bytes = 0

    def add(self, seconds: float, nbytes: int) -> None:
        self.seconds.append(seconds)
        self.bytes = nbytes

    def summary(self, per_rank_bytes: list[float]) -> dict[str, Any]:
        """The summary's figures; `per_rank_bytes`: every rank's `bytes`, in rank order."""
        if not self.seconds:
            return {}
        saves = {"total": sum(self.seconds), "median": statistics.median(self.seconds), "count": len(self.seconds)}
        return {"checkpoint_save_s": saves, "checkpoint_bytes_per_rank": [int(b) for b in per_rank_bytes]}


def row(seconds: float, nbytes: int) -> dict[str, float]:
    """A save's figures in its step's metrics row."""
    return {"ckpt_save_s": seconds, "ckpt_bytes": nbytes}


def check_owner(resume: str, candidates: list[Path], root: Path, found: list[Path]) -> None:
    """Never overwrite (or prune) checkpoints this run did not write (`found` in `root`): a folder that
    holds some is only continued (resume=auto, or a resume=PATH inside it), never started over in."""
    if not found or resume == "auto" or any(p.resolve().parent == root.resolve() for p in candidates):
        return
    raise LauncherError(
        f"{root} holds checkpoints this run did not write (newest {found[0].name}), and resume={resume} would "
        "overwrite and prune them: resume=auto continues them; a new run_dir (or checkpoint.dir) starts over"
    )
