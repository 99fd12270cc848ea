"""Export: the model weights of any sharded checkpoint, as one safetensors file with our names
(`format=safetensors`) or as a Hugging Face Llama folder (`format=hf`: config.json and safetensors
shards with HF's names, which `transformers.AutoModelForCausalLM.from_pretrained` loads).

No model code and no process group are needed: the checkpoint's metadata gives every tensor's
global shape, DCP fills full tensors from the shards. An HF folder is written one shard at a time
(`shard_gib` of tensors in memory, not the model). The checkpoint is read under the same trust rules
as a resume (launcher/train/checkpoint.py): an unreadable newest checkpoint falls back to the
previous one; none readable is a one-line error.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from launcher.config.model import ModelConfig
from launcher.errors import LauncherError
from launcher.files import shared_mode, temp_beside
from launcher.model.hf import CONFIG, INDEX, check_llama, hf_config, hf_name
from launcher.train.ckpt_pick import MARKER, complete_checkpoints, no_readable
from launcher.train.untrusted import UnreadableCheckpoint, load_shards, read_extras, verify

FORMATS = ("safetensors", "hf")


def model_tensors(metadata: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global shape and dtype of every model tensor of a checkpoint, by parameter name."""
    return {
        key.removeprefix("model."): (meta.size, meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def load_tensors(checkpoint: Path, metadata: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors `names` of a checkpoint; UnreadableCheckpoint when a file does not load."""
    specs = model_tensors(metadata)
    tensors = {name: torch.empty(specs[name][0], dtype=specs[name][1]) for name in names}
    load_shards({"model": tensors}, checkpoint, metadata)
    return tensors


def consolidated_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint folder, whole, by parameter name."""
    metadata = verify(checkpoint)
    return load_tensors(checkpoint, metadata, list(model_tensors(metadata)))


def write_safetensors(checkpoint: Path, target: Path, model: ModelConfig | None, shard_gib: float) -> Path:
    from safetensors.torch import save_file

    state = consolidated_model_state(checkpoint)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(target)  # a failed write (a full disk) leaves no half file under the name asked for
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"source": str(checkpoint)})
        shared_mode(tmp)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def shard_groups(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Names in order, cut into groups of at most `limit` bytes (a larger tensor: a group of its own)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if groups[-1] and used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


def write_hf(checkpoint: Path, target: Path, model: ModelConfig | None, shard_gib: float) -> Path:
    """An HF Llama folder: written under TARGET.partial, then renamed, so a failed export leaves none."""
    from safetensors.torch import save_file

    metadata = verify(checkpoint)
    cfg = model or saved_model(checkpoint)
    check_llama(cfg, "export-weights format=hf")
    specs = model_tensors(metadata)
    check_shapes(cfg, specs, checkpoint)
    if cfg.tied_embeddings:  # HF stores the shared matrix once, as the embedding
        specs.pop("output.weight", None)
    sizes = {name: shape.numel() * dtype.itemsize for name, (shape, dtype) in specs.items()}
    groups = shard_groups(sizes, int(shard_gib * 2**30))
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map = {}
    try:
        for i, names in enumerate(groups, 1):
            file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            tensors = load_tensors(checkpoint, metadata, names)
            save_file({hf_name(k): v.contiguous() for k, v in tensors.items()}, str(partial / file), {"format": "pt"})
            shared_mode(partial / file)
            weight_map |= {hf_name(k): file for k in names}
            del tensors  # one shard in memory at a time
        index = {"metadata": {"total_size": sum(sizes.values()), "source": str(checkpoint)}, "weight_map": weight_map}
        (partial / INDEX).write_text(json.dumps(index, indent=2))
        (partial / CONFIG).write_text(json.dumps(hf_config(cfg), indent=2))
    except BaseException:  # an unreadable shard, a full disk: no half folder left
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    return target


def check_shapes(cfg: ModelConfig, specs: dict[str, tuple[torch.Size, torch.dtype]], checkpoint: Path) -> None:
    """The config written must describe the tensors written: the model's parameters are the checkpoint's."""
    from launcher.model.init import meta_model

    for name, p in meta_model(cfg).named_parameters():
        held = tuple(specs[name][0]) if name in specs else None
        if held != tuple(p.shape):
            found = f"holds {name} with shape {held}" if held else f"holds no {name}"
            raise LauncherError(
                f"export-weights: {checkpoint} {found} but model '{cfg.name}' has {tuple(p.shape)}: give the model "
                "it was trained with (model=NAME), or none where the checkpoint records it"
            )


def saved_model(checkpoint: Path) -> ModelConfig:
    """The architecture a checkpoint was trained with (saved beside its step since format=hf exists)."""
    saved = read_extras(checkpoint).get("model")
    if not isinstance(saved, dict):
        raise LauncherError(f"export-weights: {checkpoint} does not record its model: add model=NAME (e.g. model=tiny)")
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))  # nested moe too


WRITERS: dict[str, Callable[[Path, Path, ModelConfig | None, float], Path]] = {
    "safetensors": write_safetensors,
    "hf": write_hf,
}


def check_target(out: Path, fmt: str) -> None:
    """Before reading anything: `out` can be written where it is (its nearest existing folder is a writable
    folder), a safetensors file is not a folder, and an HF export replaces a folder only when it is an
    earlier HF export (it holds config.json)."""
    existing = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        why = "is not a folder" if not existing.is_dir() else "is not writable"
        raise LauncherError(f"export-weights: cannot write {out}: {existing} {why}: choose another destination")
    if fmt == "safetensors" and out.is_dir():
        raise LauncherError(f"export-weights: {out} is a folder: give a file name (e.g. {out / 'model.safetensors'})")
    if fmt == "hf" and out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / CONFIG).is_file())):
        raise LauncherError(f"export-weights: {out} exists and is not a Hugging Face folder: give a new folder")


def export(
    source: str, out: str, fmt: str = "safetensors", model: ModelConfig | None = None, shard_gib: float = 5.0
) -> Path:
    """Write `out` from a checkpoint folder, or the newest readable one under a folder: a safetensors file
    (`fmt="safetensors"`) or an HF Llama folder (`fmt="hf"`; `model`: the architecture when the checkpoint
    does not record it)."""
    if fmt not in WRITERS:
        raise LauncherError(f"export-weights: format={fmt}: choose one of {', '.join(FORMATS)}")
    path, target = Path(source).expanduser(), Path(out).expanduser()
    check_target(target, fmt)
    candidates = [path] if (path / MARKER).is_file() else complete_checkpoints(path)
    if not candidates:
        raise LauncherError(
            f"export-weights: {source} holds no complete checkpoint; give a step_* folder or its parent"
        )
    failures: list[tuple[Path, str]] = []
    for checkpoint in candidates:
        try:
            written = WRITERS[fmt](checkpoint, target, model, shard_gib)
            print(exported_line(checkpoint, written, fmt), file=sys.stderr)  # stdout: the path alone, for scripts
            return written
        except OSError as err:  # the destination: a full disk, a quota, a vanished mount
            raise LauncherError(
                f"export-weights: writing {target} failed ({err.strerror or err}): free space or choose another "
                "destination"
            ) from None
        except UnreadableCheckpoint as err:
            failures.append((checkpoint, str(err)))
            print(f"warning: checkpoint {checkpoint} is unreadable ({err}); trying the previous one", file=sys.stderr)
    raise no_readable(candidates[0].parent, failures, "export-weights: give another checkpoint folder")


def exported_line(checkpoint: Path, written: Path, fmt: str) -> str:
    """The line that confirms an export: which checkpoint, where, how big."""
    from launcher.metrics.summary_view import size

    files = [written] if written.is_file() else [p for p in written.rglob("*") if p.is_file()]
    what = "an HF Llama folder" if fmt == "hf" else "safetensors"
    total = size(sum(p.stat().st_size for p in files))
    return f"export-weights: {checkpoint.name} of {checkpoint.parent} written to {written} ({what}, {total})"
