"""A distributed checkpoint's (DCP) index, read from a disk the project does not trust.

DCP stores its index, `.metadata`, as a Python pickle and reads it with the full unpickler, which runs
whatever code a crafted file names. A checkpoint may come from a shared or downloaded disk, so the
project reads `.metadata` with an unpickler that admits only the classes a DCP index holds
(`compat.SafeFileSystemReader` uses it), and checks that every item of a shard file is a torch.save
record before torch reads it. torch is imported only when an index is read.
"""

from __future__ import annotations

import pickle
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# Everything a DCP `.metadata` pickle references (torch 2.11 .. 2.15), besides dtypes (`torch.float32`).
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
        import torch

        if (module, name) in DCP_METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in .metadata")


def load_dcp_metadata(stream: IO[bytes]) -> Metadata:
    """A DCP index from `stream`, admitting only DCP's own classes; UnpicklingError otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"unexpected object {type(metadata).__name__} in .metadata")
    return metadata


# DCP writes every item of a shard file with torch.save, whose records are zip archives (torch >= 1.6).
TORCH_SAVE_MAGIC = b"PK\x03\x04"


def dcp_storage_items(metadata: Metadata) -> dict[str, list[tuple[int, int]]]:
    """(offset, length) of every item in each shard file, by file name, from the index's `_StorageInfo`s."""
    items: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        items.setdefault(info.relative_path, []).append((info.offset, info.length))
    return items
