"""Initial weights that do not depend on the layout: each parameter's values are a pure function of
(seed, parameter name), so one process, tp=2, pp=2, FSDP, HSDP ... all start from the same model.

A rank holds its parameters as meta tensors (shapes only, after `parallelize` cut them); `materialize`
allocates its local shards (`to_empty`) and fills each from the parameter's values, generated on the
CPU in blocks of rows, each block from its own generator seeded by (seed, name, block): a rank draws
only the blocks its shard overlaps (a row-parallel shard, a slice of columns, still draws its rows'
blocks whole: a generator cannot skip), so initializing adds one block (`BLOCK`) per drawing thread,
neither a whole parameter nor the model. The blocks are independent, so torch's intra-op threads draw
them in parallel (the same values whatever the thread count). Names are the full model's
(`layers.5.wo.weight`, also on a pipeline stage), so the same name gives the same values wherever it
lives. Weights read from a folder instead (init.from) fill the allocated shards the same way, box by
box (`fill_from`, launcher/model/hf.py `load_weights`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.compat.torch_compat import local_shard_extent
from launcher.config.model import ModelConfig
from launcher.model.knobs import PLAIN, Knobs
from launcher.model.moe import MoE
from launcher.model.transformer import Transformer

RESIDUAL = ("wo.weight", "w2.weight", "experts.w2")  # projections into the residual stream (GPT-2: scaled by depth)
BLOCK = 2**24  # elements of a parameter generated at once: 64 MiB of fp32, the most initializing adds


class WeightSource(Protocol):
    """Initial weights read from somewhere (an HF folder, launcher/model/hf.py) instead of drawn."""

    def fill_(self, local: torch.Tensor, name: str, offset: tuple[int, ...]) -> None: ...


def meta_model(cfg: ModelConfig, knobs: Knobs = PLAIN) -> Transformer:
    """The model on the meta device: shapes and names, no storage (what `parallelize` cuts); `knobs`:
    the run's (launcher/model/knobs.py `run_knobs`)."""
    with torch.device("meta"):
        return Transformer(cfg, knobs)


def name_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, name): a stable hash, not Python's salted `hash`."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows of a parameter generated together: BLOCK elements (one row at least)."""
    return max(1, BLOCK // math.prod(shape[1:]))


def fill_jobs(
    local: torch.Tensor, cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...], offset: tuple
) -> list[Callable[[], None]]:
    """Writing the box of parameter `name` (global `shape`) at `offset`, of `local`'s shape, into
    `local`, as independent pieces of work, each writing its own rows.

    Norm weights are 1, biases 0; matrices N(0, init_std), residual projections N(0, init_std /
    sqrt(2 n_layers)) (GPT-2). A matrix is drawn in blocks of `block_rows` rows, block b from its own
    generator seeded by (seed, name, b): a rank draws only the blocks its rows overlap."""
    if len(shape) == 1:
        return [lambda: local.fill_(1.0 if name.endswith("norm.weight") else 0.0)]
    std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(RESIDUAL) else cfg.init_std
    rows = block_rows(shape)
    first, last = offset[0], offset[0] + local.shape[0]  # this rank's rows: [first, last)

    def draw(b: int) -> None:
        lo, hi = b * rows, min((b + 1) * rows, shape[0])
        gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, f"{name}/{b}"))
        with allocating((hi - lo) * math.prod(shape[1:]) * 4, f"a block of {name} (fp32, to initialize)"):
            block = torch.randn((hi - lo, *shape[1:]), generator=gen).mul_(std)
        piece = block[max(lo, first) - lo : min(hi, last) - lo]
        for dim in range(1, len(shape)):
            piece = piece.narrow(dim, offset[dim], local.shape[dim])
        local[max(lo, first) - first : min(hi, last) - first].copy_(piece)

    return [functools.partial(draw, b) for b in range(first // rows, -(-last // rows))]


def run_jobs(jobs: list[Callable[[], None]], threads: int) -> None:
    """Every job, on `threads` threads (torch's kernels release the GIL); the first failure is raised."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="init") as pool:
        for done in [pool.submit(without_grad, job) for job in jobs]:
            done.result()


@torch.no_grad()  # grad mode is per thread: the pool's start with it on
def without_grad(job: Callable[[], None]) -> None:
    job()


def extent(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this rank's part of `p` lies in the whole parameter: (shape, offset), by its placements."""
    if not isinstance(p, DTensor):
        return tuple(p.shape), (0,) * p.ndim
    mesh = p.device_mesh
    return local_shard_extent(p.shape, mesh.shape, mesh.get_coordinate(), p.placements)


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


@contextlib.contextmanager
def tied_output(part: nn.Module) -> Iterator[None]:
    """Around what replaces a part's parameters module by module (`to_empty`, the tensor-parallel
    plan): the output projection that shares the embedding's weight (tied embeddings) lets go of it
    first, so it is neither allocated nor cut twice, and shares the embedding's new one after."""
    tied = part.output is not None and part.tok_embeddings is not None
    tied = tied and part.output.weight is part.tok_embeddings.weight
    if tied:
        part.output.weight = None
    yield
    if tied:
        part.output.weight = part.tok_embeddings.weight


def init_name(cfg: ModelConfig, name: str) -> str:
    """The name a parameter's values are drawn under: a pipeline stage's copy of a tied embedding (the
    last stage's output weight) starts as the embedding (launcher/parallel/tied.py)."""
    return "tok_embeddings.weight" if cfg.tied_embeddings and name == "output.weight" else name


def local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.numel() * local.element_size()


def local_params(parts: list[nn.Module]) -> Iterator[tuple[nn.Module, str, torch.Tensor, torch.Tensor, tuple]]:
    """Each parameter of `parts` (allocated) once, tied embeddings once: (its part, its name, the
    parameter, this rank's part of it, where that part lies in the whole)."""
    done: set[int] = set()
    for part in parts:
        for name, p in part.named_parameters():
            if id(p) in done:
                continue
            done.add(id(p))
            local = p.to_local() if isinstance(p, DTensor) else p
            shape, offset = extent(p)
            assert tuple(local.shape) == shape, f"{name}: local shard {tuple(local.shape)}, placements say {shape}"
            yield part, name, p, local, offset


@torch.no_grad()
def materialize(parts: list[nn.Module], seed: int, device: torch.device, draw: bool = True) -> None:
    """Allocate this rank's shards of `parts` (Transformers or pipeline stages of one, on meta) on
    `device` and, with `draw`, initialize them seeded random (without: the caller fills them next,
    `fill_from`); recompute their buffers (RoPE tables, MoE routing biases and counters)."""
    for part in parts:
        with allocating(sum(local_bytes(p) for p in part.parameters()), "this rank's shards"), tied_output(part):
            part.to_empty(device=device)
    if draw:
        jobs: list[Callable[[], None]] = []
        for part, name, p, local, offset in local_params(parts):
            jobs += fill_jobs(local, part.cfg, seed, init_name(part.cfg, name), tuple(p.shape), offset)
        run_jobs(jobs, torch.get_num_threads())
    for part in parts:
        part.reset_buffers()
        for module in part.modules():  # MoE routing biases and counters start at zero
            if isinstance(module, MoE):
                module.reset_buffers()


@torch.no_grad()
def fill_from(parts: list[nn.Module], source: WeightSource) -> None:
    """This rank's shards of `parts` (allocated) read from `source`: each rank reads only its own boxes."""
    for _, name, _, local, offset in local_params(parts):
        source.fill_(local, name, offset)


def initialized_model(cfg: ModelConfig, seed: int, device: torch.device, knobs: Knobs = PLAIN) -> Transformer:
    """The whole model, allocated and initialized as every layout starts from it (one process)."""
    model = meta_model(cfg, knobs)
    materialize([model], seed, device)
    return model
