"""Parallelism is applied here, in one place and in a fixed order, for every world size (a world of
one takes the same steps, each a no-op at degree 1, and gets the plain runner):
pipeline split → float8 conversion (dtype=fp8) → tensor (async TP with it), context and expert parallel
→ activation checkpointing → compile → data parallel.

`parallelize` reads only the Layout, the mesh and the BuildOptions (launcher/config/options.py), and returns
a step runner (launcher/parallel/runner.py). It sets nothing on the model for the run: what the model
computes with (loss chunks, kernels, scales) it was built with (launcher/model/knobs.py), and a folder's
weights (init.from) the rank's setup reads into the shards after (launcher/model/hf.py `load_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from launcher.compat.torch_compat import enable_async_tp
from launcher.config.model import ModelConfig
from launcher.config.options import BuildOptions
from launcher.config.precision import autocast_for, fsdp_policy
from launcher.layout import Layout, expert_mesh
from launcher.model.init import materialize, meta_model
from launcher.model.knobs import run_knobs
from launcher.parallel.compiled import compile_blocks, compiled_units
from launcher.parallel.context import apply_context_parallel
from launcher.parallel.data import apply_data_parallel
from launcher.parallel.expert import parallelize_experts
from launcher.parallel.float8 import convert, decide, report
from launcher.parallel.pipeline import split_weight_passes, stage_module
from launcher.parallel.recompute import apply_recompute
from launcher.parallel.runner import ParallelRunner, PipelineRunner, Runner
from launcher.parallel.tensor import apply_tensor_parallel

Allocate = Callable[..., None]  # `materialize`'s signature: (parts, seed, device, draw=True)


def parallelize(
    model: nn.Module,
    layout: Layout,
    mesh: Any,
    options: BuildOptions,
    device: torch.device,
    allocate: Allocate = materialize,
) -> Runner:
    """Cut `model` (the full model on the meta device: shapes only) for this rank of `layout`, then
    allocate this rank's shards on `device` and initialize them from the seed (launcher/model/init.py;
    with init.from only allocate them: the folder's weights come next): no rank ever holds the whole
    model. Everything about the cut comes from the layout; `options` say whether to compile, in which
    precision, and the seed.

    `mesh`: the layout's DeviceMesh (`layout.build_mesh`); None for a world of one. `allocate`: `materialize`'s
    step (the simulation's allocates fake tensors: launcher/simulate/step.py).
    """
    emesh = expert_mesh(layout, mesh.device_type) if layout.ep > 1 else None
    fp8 = decide(model, options.fp8, layout.tp) if options.fp8 else {}  # the whole model's, before the split
    parts, stages = shard_model(model, layout, options, mesh, emesh, fp8)
    allocate(parts, options.seed, device, draw=not options.init_from)  # init.from: the setup reads the folder
    runner = _runner(parts, stages, layout, mesh, options, device)
    runner.fp8 = report(fp8, options.fp8) if options.fp8 else None
    if compiles(layout, options):
        runner.compiled_units = sum(len(compiled_units(b)) for part in parts for b in part.layers.values())
    return runner


def build_runner(
    cfg: ModelConfig,
    layout: Layout,
    mesh: Any,
    options: BuildOptions,
    device: torch.device,
    allocate: Allocate = materialize,
) -> Runner:
    """The model of `cfg` on meta, built with the run's knobs (launcher/model/knobs.py: the options',
    the layout's micro-batches, the device's), cut by `parallelize`: what a rank trains."""
    model = meta_model(cfg, run_knobs(cfg, options, layout.microbatches, device))
    return parallelize(model, layout, mesh, options, device, allocate)


def compiles(layout: Layout, options: BuildOptions) -> bool:
    """Whether the blocks are compiled: compile on, and a schedule whose backward torch can split (a
    zero-bubble schedule's input and weight passes need eager blocks)."""
    return options.compile and not layout.zero_bubble


def _runner(
    parts: list, stages: list[int], layout: Layout, mesh: Any, options: BuildOptions, device: torch.device
) -> Runner:
    autocast, eos = autocast_for(options.precision, device), options.document_eos
    if mesh is None:
        return Runner(parts[0], layout.micro, autocast, eos)
    kw = {"autocast": autocast, "mesh": mesh, "document_eos": eos}
    if layout.pp > 1:
        return PipelineRunner(parts, stages, layout, **kw)
    return ParallelRunner(parts, layout.micro, layout=layout, **kw)


def shard_model(
    model: nn.Module, layout: Layout, options: BuildOptions, mesh: Any, emesh: Any = None, fp8: dict | None = None
) -> tuple[list[nn.Module], list[int]]:
    """This rank's model parts, cut and wrapped in the fixed order, and the pipeline stage of each.
    `fp8`: each linear layer's float8 decision (launcher/parallel/float8.py `decide`)."""
    pipelined = layout.pp > 1
    stages = layout.pp_stages(mesh["pp"].get_local_rank()) if pipelined else [0]
    parts = [stage_module(model, s, layout.stages) for s in stages] if pipelined else [model]
    if options.async_tp:  # with the TP plan, before compile traces the blocks: the pass checks the group
        enable_async_tp(mesh["tp"].get_group().group_name)
    mp_policy = fsdp_policy(options.precision)
    for part in parts:
        if fp8:  # before the TP plan, whose hooks live on the module objects the conversion swaps
            convert(part, fp8, options.fp8)
        if layout.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], layout.sequence_parallel, local_logits=pipelined)
        if layout.cp > 1:
            apply_context_parallel(part, mesh["cp"], options.seq_len)
        tp_mesh, ep_mesh = mesh["tp"] if layout.tp > 1 else None, emesh["ep"] if emesh is not None else None
        parallelize_experts(part, tp_mesh, ep_mesh, layout.sequence_parallel)
        apply_recompute(part, layout)
        if layout.zero_bubble:
            split_weight_passes(part)
        if compiles(layout, options):
            compile_blocks(part, options.compile_backend)
        apply_data_parallel(part, mesh, layout, mp_policy=mp_policy, expert_mesh=emesh)
    return parts, stages
