"""`dry_run=true`: what every rank of the layout would hold, without processes or memory.

For one rank of each pipeline position, in this one process: a fake process group of the layout's
world size (every collective returns at once), the layout's DeviceMesh, the model on the meta device
(shapes, no storage), and the very `shard_model` the workers run: pipeline split, tensor-parallel
plan, checkpointing, FSDP/HSDP/DDP. Every rank of the layout then gets its local shard shapes from
those parameters' placements with DTensor's own layout function (the ranks of one pipeline position
run the same program with other mesh coordinates: only their shard shapes can differ, on uneven
splits). Building each of thousands of ranks would take an hour; this takes seconds, and
tests/unit/test_layout.py checks it against building every rank of small layouts.

Printed: each parameter's local shape, global shape and placement, ranks with identical holdings
listed once, and each rank's parameter memory (also x4: with fp32 gradients and AdamW's moments).
"""

from __future__ import annotations

import copy
import functools
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from launcher.config.model import ModelConfig
from launcher.config.options import BuildOptions
from launcher.flops import GIB
from launcher.layout import Layout, build_mesh, rank_of, stage_layers

PER_RANK_LINES = 64  # above this many ranks, memory is printed per group of identical ranks


@dataclass(frozen=True)
class Param:
    """A parameter as the program defines it for every rank of a pipeline position."""

    name: str
    shape: tuple[int, ...]  # global
    placements: tuple[Any, ...]  # () for a plain tensor
    mesh_dims: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    element_size: int


def meta_model(cfg: ModelConfig) -> Any:
    """The model on the meta device (shapes, no storage), with a single block: every block has the
    same shapes, so a rank's blocks are copies of it (building 126 meta blocks takes seconds)."""
    from launcher.model.init import meta_model as build_meta

    model = build_meta(replace(cfg, n_layers=1))
    model.cfg = cfg
    return model


def rank_model(template: Any, cfg: ModelConfig, layout: Layout, rank: int) -> Any:
    """A fresh meta model holding the blocks of this rank's pipeline stages, under their global names."""
    from torch import nn

    stages = layout.pp_stages(layout.coordinates(rank)["pp"]) if layout.pp > 1 else [0]
    per_stage = stage_layers(cfg.n_layers, layout.stages)
    model = copy.deepcopy(template)
    block = model.layers["0"]
    model.layers = nn.ModuleDict({str(i): copy.deepcopy(block) for s in stages for i in per_stage[s]})
    return model


def build_rank(
    cfg: ModelConfig, layout: Layout, options: BuildOptions, rank: int, template: Any = None
) -> tuple[list[Param], dict, list]:
    """Shard the meta model as `rank` would: its parameters, {name: local shape}, pipeline stages."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from launcher.compat.torch_compat import fake_store
    from launcher.parallel import shard_model

    model = rank_model(template or meta_model(cfg), cfg, layout, rank)
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=layout.world_size)
    try:
        parts, stages = shard_model(model, layout, options, build_mesh(layout, "cpu"))
        params, local, seen = [], {}, set()
        for part in parts:
            for name, p in part.named_parameters():
                if id(p) in seen:  # tied embeddings: one parameter
                    continue
                seen.add(id(p))
                if isinstance(p, DTensor):
                    mesh = p.device_mesh
                    entry = Param(name, tuple(p.shape), tuple(p.placements), tuple(mesh.mesh_dim_names or ()),
                                  tuple(mesh.shape), p.element_size())  # fmt: skip
                    local[name] = tuple(p.to_local().shape)
                else:
                    entry = Param(name, tuple(p.shape), (), (), (), p.element_size())
                    local[name] = tuple(p.shape)
                params.append(entry)
        return params, local, stages
    finally:
        dist.destroy_process_group()


@functools.cache
def _shard_shape(shape: tuple, placements: tuple, mesh_shape: tuple, coordinate: tuple) -> tuple:
    from launcher.compat.torch_compat import local_shard_extent

    return local_shard_extent(shape, mesh_shape, coordinate, placements)[0]


def _local_shape(shape: tuple, placements: tuple, mesh_dims: tuple, mesh_shape: tuple, coords: dict) -> tuple:
    if not placements:
        return shape
    # coordinates along replicated dims do not change the shard: leave them out of the cache key
    coordinate = tuple(0 if q.is_replicate() else coords[d] for q, d in zip(placements, mesh_dims))
    return _shard_shape(shape, placements, mesh_shape, coordinate)


def _key(p: Param) -> tuple:
    return p.shape, p.placements, p.mesh_dims, p.mesh_shape


def local_shapes(params: list[Param], layout: Layout, rank: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's shard shape on `rank`, from its placements and the rank's mesh coordinates."""
    coords = layout.coordinates(rank)
    shapes = {key: _local_shape(*key, coords) for key in {_key(p) for p in params}}
    return {p.name: shapes[_key(p)] for p in params}


def placement_text(p: Param) -> str:
    if not p.placements:
        return "whole"
    return ", ".join(f"{q}@{d}" for q, d in zip(p.placements, p.mesh_dims) if not q.is_replicate()) or "replicated"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ", ".join(out)


def compact(held: list[tuple[str, tuple, tuple, str]]) -> list[str]:
    """Parameter lines (name, local, global, placement), blocks with the same shapes folded into one."""
    lines, blocks = [], defaultdict(list)
    for name, *info in held:
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        if m:
            blocks[m.group(2), tuple(info)].append(int(m.group(1)))
        else:
            lines.append((name, *info))
    by_layers: dict[tuple[int, ...], list[tuple]] = defaultdict(list)
    for (rest, info), ids in blocks.items():
        by_layers[tuple(sorted(ids))].append((rest, *info))
    width = max([len(n) for n, *_ in lines] + [len(r) + 2 for v in by_layers.values() for r, *_ in v] + [10])
    fmt = "    {:<" + str(width) + "} {:>18} of {:<18} {}"
    out = [fmt.format(name, str(local), str(full), where) for name, local, full, where in lines]
    for ids, params in by_layers.items():
        out.append(f"    layers {_ranges(list(ids))} ({len(ids)} blocks), each:")
        out += [fmt.format("  " + rest, str(local), str(full), where) for rest, local, full, where in params]
    return out


def dry_run(cfg: ModelConfig, layout: Layout, options: BuildOptions, out: Any = print) -> dict[int, int]:
    """Print what every rank of `layout` would hold of model `cfg`; return {rank: parameter bytes}."""
    t0 = time.perf_counter()
    options = replace(options, compile=False)  # nothing runs: no need to compile
    template = meta_model(cfg)
    built = {}  # pipeline rank → (params, stages), from its dp 0 / tp 0 rank
    for pp_rank in range(layout.pp):
        params, local, stages = build_rank(cfg, layout, options, rank_of(layout, pp=pp_rank), template)
        assert local == local_shapes(params, layout, rank_of(layout, pp=pp_rank)), "derived shapes disagree"
        built[pp_rank] = params, stages
    # ranks of one pipeline position whose distinct (shape, placement) kinds shard alike hold alike
    kinds = {pp: sorted({_key(p) for p in params}, key=repr) for pp, (params, _) in built.items()}
    signatures: dict[tuple, list[int]] = defaultdict(list)
    for rank in range(layout.world_size):
        coords = layout.coordinates(rank)
        signatures[coords["pp"], tuple(_local_shape(*k, coords) for k in kinds[coords["pp"]])].append(rank)
    groups: dict[tuple, list[int]] = {}
    memory: dict[int, int] = {}
    for (pp_rank, _), ranks in signatures.items():
        params = built[pp_rank][0]
        shapes = local_shapes(params, layout, ranks[0])
        groups[tuple((p.name, shapes[p.name], p.shape, placement_text(p)) for p in params)] = ranks
        nbytes = sum(math.prod(shapes[p.name]) * p.element_size for p in params)
        memory.update(dict.fromkeys(ranks, nbytes))
    cp = f"cp={layout.cp} " if layout.cp > 1 else ""
    out(
        f"dry run: model {cfg.name} · layout tp={layout.tp} pp={layout.pp} {cp}dp={layout.dp} "
        f"(dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard}) · {layout.world_size} ranks · "
        f"sequence_parallel={layout.sequence_parallel} · pp_schedule={layout.schedule} · "
        f"virtual_stages={layout.virtual_stages} · recompute={layout.recompute} · "
        f"recompute_layers={layout.recompute_layers} · reshard_after_forward={layout.reshard_after_forward} · "
        f"batch {layout.micro} x {layout.microbatches} x dp {layout.dp} = {layout.global_batch} sequences"
    )
    for held, ranks in groups.items():
        out(f"ranks {_ranges(ranks)} hold ({memory[ranks[0]] / GIB:.3f} GiB of parameters each):")
        for line in compact(list(held)):
            out(line)
    if layout.world_size <= PER_RANK_LINES:
        out("per rank (coordinates, pipeline stages): parameter memory · with fp32 grads + AdamW moments (x4)")
        for rank in range(layout.world_size):
            c, gib = layout.coordinates(rank), memory[rank] / GIB
            where = f"pp {c['pp']} dp {c['dp']} tp {c['tp']}, stages {built[c['pp']][1]}"
            out(f"  rank {rank:>4} ({where}): {gib:8.3f} GiB · {4 * gib:8.3f} GiB")
    else:
        out(f"({layout.world_size} ranks: memory shown per group above; x4 with fp32 grads + AdamW moments)")
    total = sum(memory.values())
    out(f"total over ranks: {total / GIB:.2f} GiB of parameters ({time.perf_counter() - t0:.1f} s)")
    return memory
