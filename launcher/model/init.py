"""Initial weights that do not depend on the layout: each parameter's values are a pure function of
(seed, parameter name), so one process, tp=2, pp=2, FSDP, HSDP ... all start from the same model.

A rank holds its parameters as meta tensors (shapes only, after `parallelize` cut them); `materialize`
allocates its local shards (`to_empty`) and fills each from the full parameter, generated on the CPU
from its own generator one parameter at a time and freed once the rank's slice is copied out: the
extra memory is one parameter, never the model. Names are the full model's (`layers.5.wo.weight`,
also on a pipeline stage), so the same name gives the same values wherever it lives.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.compat import local_shard_extent
from launcher.config import ModelConfig
from launcher.model.transformer import Transformer

RESIDUAL = ("wo.weight", "w2.weight")  # projections into the residual stream (GPT-2: scaled by depth)


def meta_model(cfg: ModelConfig) -> Transformer:
    """The model on the meta device: shapes and names, no storage (what `parallelize` cuts)."""
    with torch.device("meta"):
        return Transformer(cfg)


def name_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, name): a stable hash, not Python's salted `hash`."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def full_value(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole parameter `name` as every layout starts from it (fp32, CPU): norm weights 1, biases
    0, matrices N(0, init_std), residual projections N(0, init_std / sqrt(2 n_layers))."""
    if len(shape) == 1:
        return torch.full(shape, 1.0 if name.endswith("norm.weight") else 0.0)
    std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(RESIDUAL) else cfg.init_std
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen).mul_(std)


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`: the DTensor's local shard by its placements (the whole of a plain tensor)."""
    if not isinstance(param, DTensor):
        return full
    mesh = param.device_mesh
    shape, offset = local_shard_extent(full.shape, mesh.shape, mesh.get_coordinate(), param.placements)
    for dim, (size, start) in enumerate(zip(shape, offset)):
        full = full.narrow(dim, start, size)
    return full


class AllocationFailed(Exception):
    """Out of memory while materializing: how many bytes the failed allocation asked for, and of what."""

    def __init__(self, nbytes: int, what: str) -> None:
        super().__init__(f"{what}: {nbytes} bytes")
        self.nbytes, self.what = nbytes, what


def out_of_memory(err: BaseException) -> bool:
    """torch's CUDA OOM, Python's MemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(err)


@contextlib.contextmanager
def allocating(nbytes: int, what: str) -> Iterator[None]:
    """Turn an out-of-memory inside into `AllocationFailed` with the bytes asked for (the allocator's
    figure when its message has one, else `nbytes`)."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if not out_of_memory(err):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(err))
        raise AllocationFailed(int(asked.group(1)) if asked else nbytes, what) from None


def local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.numel() * local.element_size()


@torch.no_grad()
def materialize(parts: list[nn.Module], seed: int, device: torch.device) -> None:
    """Allocate this rank's shards of `parts` (Transformers or pipeline stages of one, on meta) on
    `device` and initialize them; recompute their buffers (RoPE tables)."""
    done: set[int] = set()
    for part in parts:
        with allocating(sum(local_bytes(p) for p in part.parameters()), "this rank's shards"):
            part.to_empty(device=device)
        part.tie_weights()  # to_empty gave each name its own tensor
        for name, p in part.named_parameters():
            if id(p) in done:  # tied embeddings: one parameter, filled once
                continue
            done.add(id(p))
            with allocating(p.numel() * 4, f"the full parameter {name} (fp32, to initialize)"):
                full = full_value(part.cfg, seed, name, tuple(p.shape))
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(local_slice(full, p))
            del full
        part.reset_buffers()


def initialized_model(cfg: ModelConfig, seed: int, device: torch.device) -> Transformer:
    """The whole model, allocated and initialized as every layout starts from it (one process)."""
    model = meta_model(cfg)
    materialize([model], seed, device)
    return model
