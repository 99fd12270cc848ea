"""Reading a checkpoint from a disk the run does not trust: any file that fails to load (index, shards,
extras, RNG states) raises UnreadableCheckpoint naming the file, and nothing is unpickled beyond DCP's
index classes and tensors.

DCP stores its index, `.metadata`, as a Python pickle and reads it with the full unpickler, which runs
whatever code a crafted file names. A checkpoint may come from a shared or downloaded disk, so the
project reads `.metadata` with an unpickler that admits only the classes a DCP index holds
(`load_dcp_metadata`, given to `dcp_compat.SafeFileSystemReader`), and non-tensor values with
`torch.load(weights_only=True)` (`dcp_compat.SafeLoadPlanner`). tests/unit/test_compat.py checks that the
restricted unpickler reads what the full one reads from a checkpoint of the installed torch.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import Metadata

from launcher.compat.dcp_compat import TORCH_SAVE_MAGIC, SafeFileSystemReader, SafeLoadPlanner, dcp_storage_items

EXTRAS = "extras.json"
# a one-process run (and export, generate) saves and loads without a process group on purpose; DCP warns
# about that on every call. Here: every module that calls DCP imports this one.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Everything a DCP `.metadata` pickle references (torch 2.6 .. 2.13), besides dtypes (`torch.float32`).
DCP_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # looks up a torch.layout by name, e.g. "torch.strided"
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in .metadata")


def load_dcp_metadata(stream: IO[bytes]) -> Metadata:
    """A DCP index from `stream`, admitting only DCP's own classes; UnpicklingError otherwise."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"unexpected object {type(metadata).__name__} in .metadata")
    return metadata


class UnreadableCheckpoint(Exception):
    """A file of a checkpoint failed to load; the message names the file and why."""


def why(err: BaseException) -> str:
    """`Type: first sentence` of an error (torch's unpickling errors run on for paragraphs)."""
    text = str(err).strip().split("\n")[0].split(". ")[0]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def safe_reader(path: Path) -> Any:
    """DCP's file reader for the checkpoint at `path`, its index read with `load_dcp_metadata`."""
    return SafeFileSystemReader(str(path), load_dcp_metadata)


def read_metadata(path: Path) -> Any:
    """DCP's index of `path`, read with the restricted unpickler (`load_dcp_metadata`)."""
    try:
        return safe_reader(path).read_metadata()
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
    for rng in sorted(path.glob("rng_*rank*.pt")):  # the CPU's and the GPU's of each rank
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


def load_shards(state: dict[str, Any], path: Path, metadata: Any) -> None:
    """Fill `state` from the checkpoint's shards (DCP, restricted reader); UnreadableCheckpoint if any
    fails, naming the file when a scan of the shard files finds the damage."""
    try:
        dcp.load(
            state,
            storage_reader=safe_reader(path),
            planner=SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    except (Exception, CheckpointException) as err:  # a corrupt shard; DCP's own text is a traceback
        if isinstance(err, CheckpointException) and err.failures:
            err = next(iter(err.failures.values()))[0]
        check_shards(path, metadata)  # only now, on failure: each rank reads just its items on success
        raise UnreadableCheckpoint(f"shards: {why(err)}") from None
