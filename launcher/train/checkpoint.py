"""Sharded checkpoints with torch.distributed.checkpoint: atomic, pruned safely, resharding on load.

A checkpoint is a folder `step_NNNNNNNN/` holding DCP's shards (each rank writes its own), the
training extras as JSON (step, data position, LR schedule), each rank's RNG states (the CPU's, and
on CUDA its GPU's, from which dropout there draws; `rng_states`), and last a
`complete.json` marker. It is written under `step_NNNNNNNN.partial/` and renamed once every rank
has finished, so a crash mid-save leaves no folder that looks complete. Only complete checkpoints
are loaded; a newest one that fails to load is skipped for the previous one (with a warning), and
old checkpoints are deleted only after a newer one is complete.

Tensors are stored with their global shapes (DTensor and FSDP shards are resolved by DCP), so a
checkpoint written under one layout loads under another.

A checkpoint may come from an untrusted or damaged disk: nothing in it is unpickled beyond DCP's own
index classes and tensors (launcher/train/untrusted.py, the reading side), and any file that fails
to load (index, shards, extras, RNG) makes the whole checkpoint unreadable: the previous one is
tried, and when checkpoints exist but none loads, the run stops (exit 2) rather than start over and
prune them.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from launcher.config.schema import CheckpointConfig
from launcher.errors import CheckpointFailed, LauncherError
from launcher.parallel.float8 import high_precision
from launcher.train.ckpt_pick import (
    MARKER,
    RESUME_FIX,
    complete_checkpoints,
    no_readable,
    step_of,
)
from launcher.train.ckpt_write import (
    Pending,
    SaveStats,
    SizedPlanner,
    barrier,
    cause,
    commit,
    first_error,
    prepare,
    row,
    state_bytes,
    storage_writer,
)
from launcher.train.fit import gather_ranks
from launcher.train.model_view import model_view
from launcher.train.untrusted import (
    EXTRAS,
    UnreadableCheckpoint,
    load_shards,
    read_index,
    read_rng,
)

log = logging.getLogger("launcher")
FORMAT = 1


@dataclass
class Stateful:
    """What a checkpoint captures besides tensors: the loop hands these in."""

    step: int
    extras: dict[str, Any]  # JSON-able: data position, LR schedule


# each generator's state file, by name prefix: rank r's is PREFIX + f"rank{r}.pt"
RNG_FILES = ("rng_", "rng_cuda_")


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generator states by file prefix: the CPU's, and on CUDA the GPU's (dropout there)."""
    states = {"rng_": torch.get_rng_state()}
    if device.type == "cuda":
        states["rng_cuda_"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what `rng_states` saved; a state this run has no generator for (a CUDA checkpoint resumed
    on CPU), or a checkpoint without one (a CPU run's, or one from before GPU states were kept), is skipped."""
    if "rng_" in states:
        torch.set_rng_state(states["rng_"])
    if "rng_cuda_" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["rng_cuda_"], device)


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, root: Path, rank: int, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.device = device or torch.device("cpu")  # cuda: the GPU's RNG state is saved too
        self.pending: Pending | None = None  # async save in flight
        self.stats = SaveStats()
        self.unreadable: set[Path] = set()  # failed to load: kept until a newer one is saved
        self.newest_saved = -1  # step of the newest checkpoint this run completed
        # a separate gloo group keeps background checkpoint traffic off the training collectives
        self.group = dist.new_group(backend="gloo") if cfg.async_save and dist.is_initialized() else None

    # saving ---------------------------------------------------------------------------------
    def due(self, step: int, last_step: int) -> bool:
        return self.cfg.every > 0 and (step % self.cfg.every == 0 or step == last_step)

    def state(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model = model_view(parts)  # float8 weight wrappers as the plain tensors they hold: a bf16 run's state
        return high_precision(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        )

    def save(
        self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, st: Stateful, final: bool = False
    ) -> dict[str, float]:
        """Save `st`'s step; its figures for the step's metrics row ({} when it failed). A failure on any
        rank is one line on every rank; with `final` (the last step, a preemption) or on_error=stop it
        raises CheckpointFailed."""
        self.wait()  # one save in flight at a time
        t0 = time.perf_counter()
        done = self.root / f"step_{st.step:08d}"
        partial = done.with_name(done.name + ".partial")
        state = self.state(parts, optimizer)
        nbytes = state_bytes(state)
        error = prepare(partial, self.rank, rng_states(self.device), self.root, nbytes)  # before DCP's collectives
        if not error:
            try:
                writer, planner = storage_writer(partial, st.step, self.rank), SizedPlanner(self.root, st.step)
                no_dist = not dist.is_initialized()
                if self.cfg.async_save:
                    future = dcp.async_save(
                        state, storage_writer=writer, planner=planner, process_group=self.group, no_dist=no_dist
                    )
                    self.pending = Pending(future, partial, done, st, final, nbytes, time.perf_counter() - t0)
                    return row(self.pending.seconds, nbytes)  # the time training waited
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=no_dist)
            except (Exception, CheckpointException) as err:  # CheckpointException: every rank's, from DCP
                error = cause(err, self.root, nbytes)
            error = first_error(error) or commit(partial, done, self.files(st), self.rank, self.root, nbytes)
        if error:
            self._abandon(partial, st.step, error, final)
            return {}
        seconds = time.perf_counter() - t0
        self._finish(done, st, seconds, nbytes)
        return row(seconds, nbytes)

    def wait(self) -> None:
        """Complete an async save in flight (marker, rename, prune), or report its failure as `save` does."""
        if self.pending is None:
            return
        p, self.pending = self.pending, None
        error = ""
        try:
            p.future.result()
        except (Exception, CheckpointException) as err:
            error = cause(err, self.root, p.nbytes)
        error = first_error(error) or commit(p.partial, p.done, self.files(p.st), self.rank, self.root, nbytes=p.nbytes)
        if error:
            self._abandon(p.partial, p.st.step, error, p.final)
            return
        self._finish(p.done, p.st, p.seconds, p.nbytes)

    def _abandon(self, partial: Path, step: int, error: str, final: bool) -> None:
        """A failed save: its partial folder removed, the previous checkpoint kept; one line, or (final,
        on_error=stop) CheckpointFailed."""
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        kept = complete_checkpoints(self.root)
        line = f"checkpoint at step {step} failed: {error}; {partial} removed, kept {kept[0] if kept else 'none'}"
        log.warning(line)
        if final or self.cfg.on_error == "stop":
            raise CheckpointFailed(f"{line}: fix the disk or set checkpoint.dir, then rerun to resume")
        if self.rank == 0:
            print(f"warning: {line}", flush=True)

    def files(self, st: Stateful) -> dict[str, str]:
        """What rank 0 writes once every rank's shards are on disk: the extras, and last the marker."""
        marker = {"format": FORMAT, "step": st.step, "time": time.time()}
        return {EXTRAS: json.dumps({"step": st.step, **st.extras}), MARKER: json.dumps(marker)}

    def _finish(self, done: Path, st: Stateful, seconds: float, nbytes: int) -> None:
        self.unreadable.discard(done)
        self.newest_saved = max(self.newest_saved, st.step)
        self.stats.add(seconds, nbytes)
        if self.rank == 0:
            self.prune()
        barrier()
        log.info("checkpoint step %d saved to %s in %.2fs (%d bytes on this rank)", st.step, done, seconds, nbytes)

    def summary(self) -> dict[str, Any]:
        """The saves' figures for the run's summary (every rank calls this: it gathers each one's bytes)."""
        return self.stats.summary(gather_ranks(float(self.stats.bytes))) if self.stats.seconds else {}

    def prune(self) -> None:
        """Delete complete checkpoints beyond `keep` (newest kept) and stale partial folders. One that
        failed to load is never deleted while no newer checkpoint has been saved: it may be repairable."""
        complete = complete_checkpoints(self.root)
        protected = {p for p in self.unreadable if step_of(p) > self.newest_saved}
        for old in [p for p in complete if p not in protected][max(self.cfg.keep, 1) :]:
            shutil.rmtree(old, ignore_errors=True)
        newest = step_of(complete[0]) if complete else -1
        for partial in self.root.glob("step_*.partial"):
            if step_of(partial) < newest:
                shutil.rmtree(partial, ignore_errors=True)

    # loading --------------------------------------------------------------------------------
    def load(self, candidates: list[Path], parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> Stateful | None:
        """Load the newest candidate that loads on every rank; None when there are no candidates.
        Raises LauncherError when there are some but none loads."""
        failures: list[tuple[Path, str]] = []
        for path in candidates:
            state = self.state(parts, optimizer)
            error, extras, rng = "", {}, {}
            try:  # this rank's files only: the launcher verified the rest once (preflight_resume)
                metadata, extras = read_index(path)
                check_shapes(path, metadata, state)  # another model: a LauncherError on every rank
                files = {prefix: path / f"{prefix}rank{self.rank}.pt" for prefix in RNG_FILES}
                rng = {prefix: read_rng(f) for prefix, f in files.items() if f.is_file()}  # other world sizes: none
            except UnreadableCheckpoint as err:
                error = str(err)
            error = first_error(error)  # agreed before DCP's collective load, which every rank must enter
            if not error:
                try:
                    load_shards(state, path, metadata)
                except UnreadableCheckpoint as err:
                    error = str(err)
                error = first_error(error)
            if error:
                failures.append((path, error))
                self.unreadable.add(path)
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, error)
                if self.rank == 0:
                    print(
                        f"warning: checkpoint {path} is unreadable ({error}); falling back to the previous one",
                        flush=True,
                    )
                continue
            model = model_view(parts)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optim"])
            set_rng_states(rng, self.device)  # same world size: exact continuation of dropout randomness
            log.info("resumed from %s at step %d", path, extras["step"])
            return Stateful(step=int(extras.pop("step")), extras=extras)
        if failures:
            raise no_readable(candidates[0].parent, failures, RESUME_FIX)
        return None


def check_shapes(path: Path, metadata: Any, state: dict[str, Any]) -> None:
    """A checkpoint of another model shape: name the first tensor that differs."""
    saved_shapes = metadata.state_dict_metadata
    for fqn, tensor in state["model"].items():
        saved = getattr(saved_shapes.get(f"model.{fqn}"), "size", None)
        if saved is not None and tuple(saved) != tuple(tensor.shape):
            raise LauncherError(
                f"checkpoint {path} holds {fqn} with shape {tuple(saved)} but the model has {tuple(tensor.shape)}: "
                "resume it with the model it was trained with, or start over in a new run_dir"
            )
