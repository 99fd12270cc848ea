"""Reading a checkpoint's index from a disk the run does not trust.

DCP stores its index, `.metadata`, as a Python pickle and reads it with the full unpickler, which runs
whatever code a crafted file names. A checkpoint may come from a shared or downloaded disk, so the
project reads `.metadata` with an unpickler that admits only the classes a DCP index holds
(`load_dcp_metadata`, used by `compat.SafeFileSystemReader`), and non-tensor values with
`torch.load(weights_only=True)` (`compat.SafeLoadPlanner`). tests/test_compat.py checks that the
restricted unpickler reads what the full one reads from a checkpoint of the installed torch.
"""

from __future__ import annotations

import pickle
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

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
