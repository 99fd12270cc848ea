"""Sharded checkpoints with torch.distributed.checkpoint: atomic, pruned safely, resharding on load.

A checkpoint is a folder `step_NNNNNNNN/` holding DCP's shards (each rank writes its own), the
training extras as JSON (step, data position, LR schedule), each rank's RNG state, and last a
`complete.json` marker. It is written under `step_NNNNNNNN.partial/` and renamed once every rank
has finished, so a crash mid-save leaves no folder that looks complete. Only complete checkpoints
are loaded; a newest one that fails to load is skipped for the previous one (with a warning), and
old checkpoints are deleted only after a newer one is complete.

Tensors are stored with their global shapes (DTensor and FSDP shards are resolved by DCP), so a
checkpoint written under one layout loads under another.

A checkpoint may come from an untrusted or damaged disk: nothing in it is unpickled beyond DCP's own
index classes and tensors (launcher/compat.py), and any file that fails to load (index, shards, extras,
RNG) makes the whole checkpoint unreadable: the previous one is tried, and when checkpoints exist but
none loads, the run stops (exit 2) rather than start over and prune them.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
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
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from launcher.compat import SafeFileSystemReader, SafeLoadPlanner
from launcher.config import CheckpointConfig, LauncherError
from launcher.train.dcp_index import TORCH_SAVE_MAGIC, dcp_storage_items
from launcher.train.preemption import agree

log = logging.getLogger("launcher")
# a one-process run saves without a process group on purpose; DCP warns about that on every call
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
MARKER = "complete.json"
EXTRAS = "extras.json"
FORMAT = 1
NAME = re.compile(r"step_\d{8}")


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1].split(".")[0])


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and NAME.fullmatch(p.name)]
    return sorted((p for p in found if (p / MARKER).is_file()), key=step_of, reverse=True)


class UnreadableCheckpoint(Exception):
    """A file of a checkpoint failed to load; the message names the file and why."""


def why(err: BaseException) -> str:
    """`Type: first sentence` of an error (torch's unpickling errors run on for paragraphs)."""
    text = str(err).strip().split("\n")[0].split(". ")[0]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def read_metadata(path: Path) -> Any:
    """DCP's index of `path`, read with the restricted unpickler (launcher/compat.py)."""
    try:
        return SafeFileSystemReader(str(path)).read_metadata()
    except pickle.UnpicklingError as err:
        raise UnreadableCheckpoint(str(err)) from None  # "unexpected object X in .metadata"
    except Exception as err:
        raise UnreadableCheckpoint(f".metadata: {why(err)}") from None


def read_extras(path: Path) -> dict[str, Any]:
    try:
        extras = json.loads((path / EXTRAS).read_text())
    except (OSError, ValueError) as err:
        raise UnreadableCheckpoint(f"{EXTRAS}: {why(err)}") from None
    if not isinstance(extras, dict) or not isinstance(extras.get("step"), int):
        raise UnreadableCheckpoint(f"{EXTRAS}: not an object with an integer step")
    return extras


def read_rng(file: Path) -> torch.Tensor:
    try:
        with warnings.catch_warnings():  # a foreign pickle protocol warns before it fails: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(file, weights_only=True)
    except Exception as err:
        raise UnreadableCheckpoint(f"{file.name}: {why(err)}") from None
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise UnreadableCheckpoint(f"{file.name}: not an RNG state (a uint8 tensor)")
    return state


def read_index(path: Path) -> tuple[Any, dict[str, Any]]:
    """A checkpoint's index and extras: what every rank reads to load it. Raises UnreadableCheckpoint."""
    return read_metadata(path), read_extras(path)


def verify(path: Path) -> Any:
    """What can be checked without the model, by one process for all ranks: the index, the extras,
    every RNG file, and that every shard file holds the bytes the index points into, each item
    starting as a torch.save record. Returns the index; raises UnreadableCheckpoint."""
    metadata, _ = read_index(path)
    for rng in sorted(path.glob("rng_rank*.pt")):
        read_rng(rng)
    check_shards(path, metadata)
    return metadata


def check_shards(path: Path, metadata: Any) -> None:
    """Every shard file holds the bytes the index points into, each item starting as a torch.save
    record (zeroed or foreign bytes fail here, naming the file); raises UnreadableCheckpoint."""
    for name, items in dcp_storage_items(metadata).items():
        shard, needed = path / name, max(offset + length for offset, length in items)
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < needed:
            what = "missing" if size is None else f"truncated ({size} of {needed} bytes)"
            raise UnreadableCheckpoint(f"{name}: {what}")
        with shard.open("rb") as stream:  # each item a torch.save record: zeroed or foreign bytes fail here
            for offset, _ in items:
                stream.seek(offset)
                if stream.read(len(TORCH_SAVE_MAGIC)) != TORCH_SAVE_MAGIC:
                    raise UnreadableCheckpoint(f"{name}: no tensor record at byte {offset}")


def no_readable(root: Path, failures: list[tuple[Path, str]], fix: str) -> LauncherError:
    path, why = failures[0]
    return LauncherError(
        f"no readable checkpoint under {root} ({len(failures)} found, newest {path.name}: {why}); {fix}"
    )


RESUME_FIX = "resume=never starts over, resume=PATH picks one"


def preflight_resume(resume: str, default_root: Path, every_rank: bool = False) -> None:
    """Before any worker starts: a bad resume path, or checkpoints none of which passes `verify`,
    is one line (exit 2); training from step 0 would prune them. `every_rank`: each rank runs this
    (torchrun, SLURM), so each reads only the index and extras, not every rank's files."""
    candidates = resolve_resume(resume, default_root)
    failures = []
    for path in candidates:
        try:
            read_index(path) if every_rank else verify(path)
            return
        except UnreadableCheckpoint as err:
            failures.append((path, str(err)))
    if failures:
        raise no_readable(failures[0][0].parent, failures, RESUME_FIX)


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
        self.unreadable: set[Path] = set()  # failed to load: kept until a newer one is saved
        self.newest_saved = -1  # step of the newest checkpoint this run completed
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
            if final.exists():  # an older run's checkpoint of this step (superseded by this one)
                shutil.rmtree(final)
            partial.rename(final)
        self.unreadable.discard(final)
        self.newest_saved = max(self.newest_saved, st.step)
        if self.rank == 0:
            self.prune()
        _barrier()
        log.info("checkpoint step %d saved to %s in %.2fs", st.step, final, seconds)

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
            error, extras, rng = "", {}, None
            try:  # this rank's files only: the launcher verified the rest once (preflight_resume)
                metadata, extras = read_index(path)
                check_shapes(path, metadata, state)  # another model: a LauncherError on every rank
                rng_file = path / f"rng_rank{self.rank}.pt"
                rng = read_rng(rng_file) if rng_file.is_file() else None  # other world sizes have none
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
            if rng is not None:  # same world size: exact continuation of dropout randomness
                torch.set_rng_state(rng)
            log.info("resumed from %s at step %d", path, extras["step"])
            return Stateful(step=int(extras.pop("step")), extras=extras)
        if failures:
            raise no_readable(candidates[0].parent, failures, RESUME_FIX)
        return None


def load_shards(state: dict[str, Any], path: Path, metadata: Any) -> None:
    """Fill `state` from the checkpoint's shards (DCP, restricted reader); UnreadableCheckpoint if any
    fails, naming the file when a scan of the shard files finds the damage."""
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    except (Exception, CheckpointException) as err:  # a corrupt shard; DCP's own text is a traceback
        if isinstance(err, CheckpointException) and err.failures:
            err = next(iter(err.failures.values()))[0]
        check_shards(path, metadata)  # only now, on failure: each rank reads just its items on success
        raise UnreadableCheckpoint(f"shards: {why(err)}") from None


def first_error(error: str) -> str:
    """The first rank's error, on every rank ("" when every rank loaded): ranks must agree to fall back."""
    if not dist.is_initialized() or agree(not error, dist.ReduceOp.MIN):
        return error
    errors: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"{e} (rank {r})" if r else e for r, e in enumerate(errors) if e), "")


def check_shapes(path: Path, metadata: Any, state: dict[str, Any]) -> None:
    """A checkpoint of another model shape: name the first tensor that differs."""
    saved_shapes = metadata.state_dict_metadata
    for fqn, tensor in state["model"].items():
        saved = getattr(saved_shapes.get(f"model.{fqn}"), "size", None)
        if saved is not None and tuple(saved) != tuple(tensor.shape):
            raise LauncherError(
                f"checkpoint {path} holds {fqn} with shape {tuple(saved)} but the model has {tuple(tensor.shape)}: "
                "resume it with the model it was trained with, or resume=never"
            )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
