"""Private PyTorch APIs the project relies on, each in one place with a test (tests/test_compat.py) that
fails loudly when an upgrade changes them.

Distributed checkpoint (DCP) reading: DCP stores its index, `.metadata`, as a Python pickle and reads it
with the full unpickler, which runs whatever code a crafted file names. A checkpoint may come from a
shared or downloaded disk, so the project reads `.metadata` with an unpickler that admits only the
classes a DCP index holds, and non-tensor values with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the restricted `.metadata` unpickler (tensors are already read with
    `torch.load(weights_only=True)` by DCP itself)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_dcp_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:  # what FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor values (optimizer hyper-parameters) are read with
    `weights_only=True`: DefaultLoadPlanner unpickles them with the full unpickler."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_file_extents(metadata: Metadata) -> dict[str, int]:
    """Bytes each shard file must hold, by file name, from the index's storage records (`_StorageInfo`)."""
    extents: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    return extents
