"""The private PyTorch APIs of distributed checkpoint (DCP) reading that the project uses (the rest:
compat/torch_compat.py): a file reader and load planner that trust nothing on disk beyond DCP's own index classes
and tensors, and the index's storage records. Each has a test in tests/unit/test_compat.py.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


@functools.cache
def _dcp_classes() -> dict[str, type]:
    """DCP's reader and load planner that trust nothing on disk beyond DCP's own index classes and
    tensors (launcher/train/untrusted.py says why and reads with them), built on first use (they subclass torch's
    classes: defining them at import would import torch)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file reader with `.metadata` read by `load_metadata`, the restricted unpickler
        (tensors are already read with `torch.load(weights_only=True)` by DCP itself)."""

        def __init__(self, path: str, load_metadata: Callable[[IO[bytes]], Metadata]) -> None:
            super().__init__(path)
            self.load_metadata = load_metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = self.load_metadata(stream)
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

    return {"SafeFileSystemReader": SafeFileSystemReader, "SafeLoadPlanner": SafeLoadPlanner}


def __getattr__(name: str) -> Any:
    """`from launcher.compat.dcp_compat import SafeFileSystemReader` (or SafeLoadPlanner) builds them then."""
    if name in ("SafeFileSystemReader", "SafeLoadPlanner"):
        return _dcp_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# DCP writes every item of a shard file with torch.save, whose records are zip archives (torch >= 1.6).
TORCH_SAVE_MAGIC = b"PK\x03\x04"


def dcp_storage_items(metadata: Metadata) -> dict[str, list[tuple[int, int]]]:
    """(offset, length) of every item in each shard file, by file name, from the index's `_StorageInfo`s."""
    items: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        items.setdefault(info.relative_path, []).append((info.offset, info.length))
    return items
