"""Export: one consolidated safetensors file of the model weights from any sharded checkpoint.

No model code and no process group are needed: the checkpoint's metadata gives every tensor's
global shape, DCP fills full tensors from the shards, and the result loads with plain
`safetensors.torch.load_file` into `launcher.model.Transformer` (or anything with the same names).
The checkpoint is read under the same trust rules as a resume (launcher/train/checkpoint.py): an
unreadable newest checkpoint falls back to the previous one; none readable is a one-line error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from launcher.config import LauncherError
from launcher.train.checkpoint import (
    MARKER,
    UnreadableCheckpoint,
    complete_checkpoints,
    load_shards,
    no_readable,
    verify,
)


def consolidated_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a checkpoint folder, by parameter name; UnreadableCheckpoint
    when a file of it does not load."""
    metadata = verify(checkpoint)
    tensors = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    load_shards({"model": tensors}, checkpoint, metadata)
    return tensors


def export(source: str, out: str) -> Path:
    """Write `out` (safetensors) from a checkpoint folder, or the newest readable one under a folder."""
    from safetensors.torch import save_file

    path = Path(source).expanduser()
    candidates = [path] if (path / MARKER).is_file() else complete_checkpoints(path)
    if not candidates:
        raise LauncherError(f"export: {source} holds no complete checkpoint; give a step_* folder or its parent")
    failures: list[tuple[Path, str]] = []
    for checkpoint in candidates:
        try:
            state = consolidated_model_state(checkpoint)
        except UnreadableCheckpoint as err:
            failures.append((checkpoint, str(err)))
            print(f"warning: checkpoint {checkpoint} is unreadable ({err}); trying the previous one", file=sys.stderr)
            continue
        target = Path(out).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(target), metadata={"source": str(checkpoint)})
        return target
    raise no_readable(candidates[0].parent, failures, "export: give another checkpoint folder")
