"""Export: one consolidated safetensors file of the model weights from any sharded checkpoint.

No model code and no process group are needed: the checkpoint's metadata gives every tensor's
global shape, DCP fills full tensors from the shards, and the result loads with plain
`safetensors.torch.load_file` into `launcher.model.Transformer` (or anything with the same names).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from launcher.config import LauncherError
from launcher.train.checkpoint import MARKER, SafeLoadPlanner, complete_checkpoints


def consolidated_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a checkpoint folder, by parameter name."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    tensors = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load({"model": tensors}, checkpoint_id=str(checkpoint), planner=SafeLoadPlanner(), no_dist=True)
    return tensors


def export(source: str, out: str) -> Path:
    """Write `out` (safetensors) from a checkpoint folder, or the newest complete one under a folder."""
    from safetensors.torch import save_file

    path = Path(source).expanduser()
    candidates = [path] if (path / MARKER).is_file() else complete_checkpoints(path)
    if not candidates:
        raise LauncherError(f"export: {source} holds no complete checkpoint; give a step_* folder or its parent")
    state = consolidated_model_state(candidates[0])
    target = Path(out).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(target), metadata={"source": str(candidates[0])})
    return target
