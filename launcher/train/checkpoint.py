"""Sharded checkpoints with torch.distributed.checkpoint: atomic, pruned safely, resharding on load.

A checkpoint is a folder `step_NNNNNNNN/` holding DCP's shards (each rank writes its own), the
training extras as JSON (step, data position, LR schedule), each rank's RNG state, and last a
`complete.json` marker. It is written under `step_NNNNNNNN.partial/` and renamed once every rank
has finished, so a crash mid-save leaves no folder that looks complete. Only complete checkpoints
are loaded; a newest one that fails to load is skipped for the previous one (with a warning), and
old checkpoints are deleted only after a newer one is complete.

Tensors are stored with their global shapes (DTensor and FSDP shards are resolved by DCP), so a
checkpoint written under one layout loads under another. Non-tensor values are read back with
`torch.load(weights_only=True)`: loading never unpickles arbitrary objects.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from launcher.config import CheckpointConfig, LauncherError
from launcher.train.preemption import agree

log = logging.getLogger("launcher")
# a one-process run saves without a process group on purpose; DCP warns about that on every call
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
MARKER = "complete.json"
EXTRAS = "extras.json"
FORMAT = 1


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor values are read with weights_only=True (no arbitrary pickles)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1].split(".")[0])


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial")]
    return sorted((p for p in found if (p / MARKER).is_file()), key=step_of, reverse=True)


def resolve_resume(resume: str, default_root: Path) -> list[Path]:
    """Candidate checkpoints to resume from, newest first; an explicit path must hold one."""
    if resume == "never":
        return []
    if resume == "auto":
        return complete_checkpoints(default_root)
    path = Path(resume).expanduser()
    if not path.exists():
        raise LauncherError(f"resume={resume}: no such path; give a checkpoint folder, resume=auto or resume=never")
    if (path / MARKER).is_file():
        return [path]
    found = complete_checkpoints(path)
    if not found:
        raise LauncherError(f"resume={resume} holds no complete checkpoint (no step_*/{MARKER}): give another path")
    return found


@dataclass
class Stateful:
    """What a checkpoint captures besides tensors: the loop hands these in."""

    step: int
    extras: dict[str, Any]  # JSON-able: data position, LR schedule


def model_view(parts: list[nn.Module]) -> nn.Module:
    """One module over a rank's pipeline stages with the full model's parameter names, so state
    dicts (and optimizer state) look the same whatever the pipeline split."""
    if len(parts) == 1:
        return parts[0]
    view, layers = nn.Module(), nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():
            if name == "layers":
                layers.update(child)
            else:
                setattr(view, name, child)
    view.layers = layers
    return view


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, root: Path, rank: int) -> None:
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.pending: tuple[Future, Path, Path, Stateful] | None = None  # async save in flight
        # a separate gloo group keeps background checkpoint traffic off the training collectives
        self.group = dist.new_group(backend="gloo") if cfg.async_save and dist.is_initialized() else None

    # saving ---------------------------------------------------------------------------------
    def due(self, step: int, last_step: int) -> bool:
        return self.cfg.every > 0 and (step % self.cfg.every == 0 or step == last_step)

    def state(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model = model_view(parts)
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}

    def save(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer, st: Stateful) -> None:
        self.wait()  # one save in flight at a time
        final = self.root / f"step_{st.step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        torch.save(torch.get_rng_state(), partial / f"rng_rank{self.rank}.pt")
        state = self.state(parts, optimizer)
        t0 = time.perf_counter()
        try:
            if self.cfg.async_save:
                future = dcp.async_save(
                    state, checkpoint_id=str(partial), process_group=self.group, no_dist=not dist.is_initialized()
                )
                self.pending = (future, partial, final, st)
                return
            dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as err:  # a full disk: keep training, keep the old ones
            self._abandon(partial, st.step, err)
            return
        self._finish(partial, final, st, time.perf_counter() - t0)

    def wait(self) -> None:
        """Complete an async save in flight (marker, rename, prune)."""
        if self.pending is None:
            return
        future, partial, final, st = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as err:
            self._abandon(partial, st.step, err)
            return
        self._finish(partial, final, st, 0.0)

    def _abandon(self, partial: Path, step: int, err: BaseException) -> None:
        _barrier()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        kept = complete_checkpoints(self.root)
        log.warning("checkpoint at step %d failed (%s); kept %s", step, err, kept[0] if kept else "none")
        if self.rank == 0:
            print(f"warning: checkpoint at step {step} failed ({err}); previous checkpoint kept", flush=True)

    def _finish(self, partial: Path, final: Path, st: Stateful, seconds: float) -> None:
        _barrier()  # every rank's shards are on disk
        if self.rank == 0:
            (partial / EXTRAS).write_text(json.dumps({"step": st.step, **st.extras}))
            (partial / MARKER).write_text(json.dumps({"format": FORMAT, "step": st.step, "time": time.time()}))
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            self.prune()
        _barrier()
        log.info("checkpoint step %d saved to %s in %.2fs", st.step, final, seconds)

    def prune(self) -> None:
        """Delete complete checkpoints beyond `keep` (newest kept) and stale partial folders."""
        complete = complete_checkpoints(self.root)
        for old in complete[max(self.cfg.keep, 1) :]:
            shutil.rmtree(old, ignore_errors=True)
        newest = step_of(complete[0]) if complete else -1
        for partial in self.root.glob("step_*.partial"):
            if step_of(partial) < newest:
                shutil.rmtree(partial, ignore_errors=True)

    # loading --------------------------------------------------------------------------------
    def load(self, candidates: list[Path], parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> Stateful | None:
        """Load the newest candidate that loads on every rank; None when there is none."""
        for path in candidates:
            state = self.state(parts, optimizer)
            check_shapes(path, state)
            error = ""
            try:
                dcp.load(state, checkpoint_id=str(path), planner=SafeLoadPlanner(), no_dist=not dist.is_initialized())
                extras = json.loads((path / EXTRAS).read_text())
            except (Exception, CheckpointException) as err:  # truncated or corrupt shard, unreadable extras
                error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if not agree(not error, dist.ReduceOp.MIN):
                log.warning("checkpoint %s could not be loaded (%s); trying the previous one", path, error)
                if self.rank == 0:
                    print(
                        f"warning: checkpoint {path} is unreadable ({error or 'on another rank'}); "
                        "falling back to the previous one",
                        flush=True,
                    )
                continue
            model = model_view(parts)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optim"])
            rng = path / f"rng_rank{self.rank}.pt"
            if rng.is_file():  # same world size: exact continuation of dropout randomness
                torch.set_rng_state(torch.load(rng, weights_only=True))
            log.info("resumed from %s at step %d", path, extras["step"])
            return Stateful(step=int(extras.pop("step")), extras=extras)
        return None


def check_shapes(path: Path, state: dict[str, Any]) -> None:
    """A checkpoint of another model shape: name the first tensor that differs."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:
        return  # unreadable metadata is handled as a corrupt checkpoint by the caller
    for fqn, tensor in state["model"].items():
        key = f"model.{fqn}"
        saved = getattr(metadata.get(key), "size", None)
        if saved is not None and tuple(saved) != tuple(tensor.shape):
            raise LauncherError(
                f"checkpoint {path} holds {fqn} with shape {tuple(saved)} but the model has {tuple(tensor.shape)}: "
                "resume it with the model it was trained with, or resume=never"
            )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
