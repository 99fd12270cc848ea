"""Data parallelism on the `dp` part of the mesh, composed with tensor parallelism.

- dp_shard > 1: FSDP2 (`fully_shard`, ZeRO-3: parameters, gradients and optimizer state sharded
  over dp_shard; parameters all-gathered per block for forward and backward, gradients
  reduce-scattered). With dp_replicate > 1 as well: HSDP, sharded inside a group of dp_shard
  ranks and replicated (all-reduced) across the dp_replicate groups, on a 2-D (replicate, shard) mesh.
- dp_shard = 1, dp_replicate > 1: DDP (the composable `replicate`: whole parameters on every rank,
  gradients all-reduced).
Gradient accumulation (`set_gradient_sync`): FSDP reduce-scatters every micro-batch, so no rank
holds an unsharded gradient between micro-batches; HSDP and DDP all-reduce on the last one only.

`fsdp.reshard_after_forward` (`Layout.reshard_after_forward`): always frees each block's gathered
parameters after its forward and re-gathers them for backward (ZeRO-3); never keeps them from
forward to backward (ZeRO-2: one gather per microbatch instead of two, the stage's parameters held
whole at the end of forward; gradients and optimizer state stay sharded); auto is torchtitan's
default by stage: always without pipelining, never with it (every microbatch would re-gather).

With context parallelism the cp ranks hold the same weights and their gradients must be summed too:
FSDP shards over dp_shard x cp (one flattened mesh dimension, `dp_shard_cp`, as torchtitan does),
also when dp_shard = 1, so cp > 1 never uses DDP for its own dimension.

Each block is its own FSDP unit (one all-gather / reduce-scatter per block, overlapped by FSDP's
prefetching), and the rest (embeddings, final norm, output) is the root unit. Under tensor
parallelism the parameters are already DTensors on the tp mesh; FSDP adds the dp dimension (2-D
DTensors). gloo has neither AVG nor PREMUL_SUM reductions: there, reductions are plain sums
followed by a division (`set_force_sum_reduction_for_comms`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from launcher.compat.torch_compat import replicate, sub_mesh
from launcher.layout import Layout
from launcher.model.moe import moe_layers
from launcher.parallel.expert import expert_data_mesh, shard_experts


def apply_data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    layout: Layout,
    mp_policy: MixedPrecisionPolicy | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Wrap `model` (a whole model or a pipeline stage) in FSDP / HSDP / DDP over the dp mesh dims;
    `mp_policy`: FSDP's mixed precision (launcher/config/precision.py), None for parameters' own dtype;
    `expert_mesh` (ep > 1, `layout.expert_mesh`): the experts shard over its edp dim instead."""
    if layout.dp * layout.cp == 1:
        return
    experts = expert_data_mesh(expert_mesh, layout.dp_replicate) if expert_mesh is not None else None
    if layout.fsdp_shard > 1:
        shard = shard_dim(layout)
        dp_mesh = sub_mesh(mesh, "dp_replicate", shard) if layout.dp_replicate > 1 else sub_mesh(mesh, shard)
        shard_blocks(model, dp_mesh, layout.reshard_after_forward, mp_policy, experts, layout.dp * layout.cp)
    else:
        replicate(model, mesh=mesh["dp_replicate"])
    if dist.get_backend(mesh.get_group(shard_dim(layout) if layout.fsdp_shard > 1 else "dp_replicate")) == "gloo":
        # experts' units over one edp rank (HSDP: replicated only) excepted: no reduce-scatter, so no
        # PREMUL_SUM to avoid; and under forced sums torch 2.13 divides such a unit's gradients twice
        # (in place of the reduce-scatter, and after)
        one_rank = expert_mesh is not None and layout.edp == 1
        skip = {id(moe.experts) for moe in moe_layers([model])} if one_rank else set()
        for module in model.modules():
            if isinstance(module, FSDPModule) and id(module) not in skip:
                module.set_force_sum_reduction_for_comms(True)


def shard_dim(layout: Layout) -> str:
    """The mesh dimension FSDP shards over: dp_shard, or dp_shard x cp flattened (`layout.build_mesh`)."""
    return "dp_shard_cp" if layout.cp > 1 else "dp_shard"


def shard_blocks(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None,
    expert_mesh: DeviceMesh | None = None,
    ranks: int = 1,
) -> None:
    """FSDP2 over `dp_mesh`: each block one unit, the rest the root unit; with `expert_mesh`, each
    MoE layer's experts a unit of their own over it (gradients / `ranks`: the data-parallel ranks)."""
    fsdp = {"reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    ignored: set[nn.Parameter] = set()  # experts outside FSDP (edp = 1: `shard_experts`)
    for block in model.layers.values():
        own = shard_experts(block, expert_mesh, ranks, **fsdp) if expert_mesh is not None else set()
        fully_shard(block, mesh=dp_mesh, ignored_params=own or None, **fsdp)
        ignored |= own
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored or None, **fsdp)


def set_gradient_sync(model: nn.Module, layout: Layout, last: bool) -> None:
    """Before each micro-batch's backward. FSDP (HSDP) reduce-scatters every micro-batch and skips only
    the replicas' all-reduce until the last, as torchtitan does: skipping the reduce-scatter too would
    keep an unsharded fp32 gradient of every parameter between micro-batches (dp_shard times the
    sharded one: +11.2 GiB per GPU for llama3_8b_h100x8) for one reduce-scatter a step, which on a GPU
    overlaps backward (docs/planner.md has the measured figures). DDP accumulates its whole gradient
    either way and all-reduces on the last micro-batch only."""
    if not isinstance(model, FSDPModule):
        return
    if layout.fsdp_shard > 1:
        model.set_requires_all_reduce(last)
    else:
        model.set_requires_gradient_sync(last)
