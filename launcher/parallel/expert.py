"""Expert parallelism: each rank of an ep group holds experts/ep of every MoE layer's routed experts.

The ep ranks are carved from dp_shard (`layout.expert_mesh`, as torchtitan does): they hold
different data, and so different tokens. Per MoE layer (launcher/model/moe.py) each rank groups its
(token, expert) picks by expert, and `exchange`:
1. all-to-all of the per-expert counts (how many rows each rank will receive from each other rank);
2. all-to-all of the rows themselves (dispatch), grouped on arrival by local expert, run through
   this rank's experts;
3. the reverse all-to-all (combine) returns every output row to the rank its token lives on.
The row all-to-alls are autograd-aware (`compat.all_to_all_autograd`):
backward runs the same two exchanges the other way (four all-to-alls per layer and step).
Under `model.moe.force_balance` the counts are known on the host (every ep rank routes as many tokens,
round-robin): step 1 and every read of a count back from a tensor are left out (`balanced_split`).

Parameters: expert weights are DTensors sharded along the expert dimension over "ep" (checkpoints
hold whole tensors, so an ep=2 checkpoint loads at ep=1). The ranks holding the same experts (edp =
dp_shard / ep, x dp_replicate) FSDP-shard them further over edp (`shard_experts`, as torchtitan does
over its dp_shard_mod_ep dimension): each MoE layer's experts are their own FSDP unit inside the
block's, gathered over edp, their gradients reduce-scattered over edp (all-reduced over dp_replicate
under HSDP) and divided by dp, as FSDP averages the rest. Router and shared experts are ordinary
parameters (FSDP-sharded, replicated over tensor parallelism: `tensor_parallel_moe`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from launcher.compat.torch_compat import all_to_all_autograd, sub_mesh
from launcher.model.moe import MoE, local, moe_layers


def exchange(
    x: torch.Tensor,
    counts: torch.Tensor,
    experts: nn.Module,
    group: dist.ProcessGroup,
    host: list[int] | None = None,
) -> torch.Tensor:
    """x: this rank's rows grouped by (global) expert, counts[e] rows each → the experts' outputs,
    in the same order, computed on the ranks that hold the experts. `host`: the counts on the host
    (force_balance), the same on every ep rank: nothing is exchanged or read back to learn them."""
    ep = dist.get_world_size(group)
    if host is not None:
        send, recv, order, per_expert = balanced_split(host, ep, dist.get_rank(group), x.device)
        rows = all_to_all_autograd(x, recv, send, group)
        out = experts(rows[order], per_expert)
        back = torch.empty_like(out).index_copy_(0, order, out)
        return all_to_all_autograd(back, send, recv, group)
    per_rank = counts.numel() // ep  # experts held by each rank, contiguous: rank r holds [r*n, (r+1)*n)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # row r: rank r's rows for each of my experts
    received = received.view(ep, per_rank)
    send = counts.view(ep, per_rank).sum(1).tolist()
    recv = received.sum(1).tolist()
    rows = all_to_all_autograd(x, recv, send, group)
    # arrived grouped by source rank, then expert: regroup by expert (stable: by source inside)
    local_expert = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(received.flatten())
    order = local_expert.argsort(stable=True)
    out = experts(rows[order], received.sum(0).tolist())
    back = torch.empty_like(out).index_copy_(0, order, out)
    return all_to_all_autograd(back, send, recv, group)


def balanced_split(
    host: list[int], ep: int, rank: int, device: torch.device
) -> tuple[list[int], list[int], torch.Tensor, list[int]]:
    """`exchange`'s splits under force_balance, from the counts `host` every ep rank routes alike (as many
    tokens each, round-robin: launcher/model/moe.py): the rows sent to each rank, received from each, the
    arrived rows' order grouped by local expert (stable: by source inside, as `exchange` sorts them), and
    each local expert's rows. The order is made from host counts (`repeat_interleave` told its output's
    size): no output shape waits for a tensor's values."""
    per_rank = len(host) // ep
    mine = host[rank * per_rank : (rank + 1) * per_rank]  # what each rank sends my experts: what I send them
    send = [sum(host[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
    recv = [sum(mine)] * ep
    rows = ep * sum(mine)
    repeats = torch.tensor(mine * ep, device=device)
    local_expert = torch.arange(per_rank, device=device).repeat(ep).repeat_interleave(repeats, output_size=rows)
    return send, recv, local_expert.argsort(stable=True), [c * ep for c in mine]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every MoE layer's routed experts of `model` (meta) over the 1-D "ep" mesh, in place."""
    for moe in moe_layers([model]):
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            shard = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)
            moe.experts.register_parameter(name, nn.Parameter(shard))
        moe.exchange = partial(exchange, experts=moe.experts, group=mesh.get_group())


def tensor_parallel_moe(moe: MoE, tp_mesh: DeviceMesh, expert_parallel: bool, sequence_parallel: bool) -> None:
    """Under tensor parallelism a MoE layer's routing runs whole on every tp rank (the same tokens):
    router and experts become replicated DTensors on the tp mesh, as every parameter there is, except
    experts already sharded over ep (both are read through `to_local`). The shared experts are cut
    like the dense MLP (w1, w3 column-parallel, w2 row-parallel: one all-reduce). With sequence
    parallelism the layer all-gathers the sequence first and keeps its own positions of the output
    (identical on every tp rank: a slice, no reduction; backward all-gathers the output's gradient)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        parallelize_module,
    )

    params = [(moe, "router")]
    if not expert_parallel:
        params += [(moe.experts, name) for name in ("w1", "w2", "w3")]
    for owner, name in params:
        replicated = distribute_tensor(getattr(owner, name), tp_mesh, [Replicate()], src_data_rank=None)
        owner.register_parameter(name, nn.Parameter(replicated))
    if moe.shared is not None:
        styles = {
            "": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "w1": ColwiseParallel(),
            "w3": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=Replicate()),
        }
        for style in styles.values():
            style.src_data_rank = None  # meta tensors: cut, nothing to scatter
        parallelize_module(moe.shared, tp_mesh, styles)
    if sequence_parallel:  # (batch, seq, dim) in and out, the residual stream sharded over seq
        seq = (Shard(1),)
        gather = PrepareModuleInputOutput(
            input_layouts=seq,
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=seq,
        )
        parallelize_module(moe, tp_mesh, gather)


def expert_data_mesh(emesh: DeviceMesh, dp_replicate: int) -> DeviceMesh:
    """The ranks holding the same experts: edp, x dp_replicate (HSDP's replicate dimension, outer)."""
    return sub_mesh(emesh, "dp_replicate", "edp") if dp_replicate > 1 else emesh["edp"]


def shard_experts(block: nn.Module, mesh: DeviceMesh, divide_factor: int, **fsdp: Any) -> set[nn.Parameter]:
    """FSDP over `mesh` (`expert_data_mesh`) for each MoE layer's experts in `block`, before the block
    is wrapped (so the block's unit leaves them out). Their gradients already hold the ep ranks'
    tokens (the all-to-all's backward): summed over `mesh` and divided by every data-parallel rank
    (`divide_factor`), they are the global mean, as for the rest. Dim 0 (experts) is cut when each
    edp rank gets at least one of the rank's experts, else dim 1 (as torchtitan: no idle shards).

    Over a mesh of one rank (edp = 1, no dp_replicate) there is nothing to shard or reduce: where FSDP's
    policy casts nothing, its unit would only copy the weights and gradients through its buffers (about a
    tenth of an ep=2 step on this CPU), so the experts stay out of FSDP: returned, for the block's and the
    root's units to ignore; `Experts.forward` divides their gradients as FSDP would. Under a bf16 policy
    (the GPU path) they stay in a unit of one rank: its cast is freed after the layer's forward and made
    again for its backward, where a cast of their own would be saved by every micro-batch in flight until
    its backward (mixtral ep=8 tp=2 pp=2: 0.33 GiB a layer and micro-batch, bench simulate_grid)."""
    if mesh.size() == 1 and fsdp["mp_policy"].param_dtype is None:
        for moe in moe_layers([block]):
            moe.experts.grad_divide = float(divide_factor)
        return {p for moe in moe_layers([block]) for p in moe.experts.parameters()}
    for moe in moe_layers([block]):
        held = local(moe.experts.w1).shape[0]
        dim = 0 if held >= mesh.size(mesh.ndim - 1) else 1
        fully_shard(moe.experts, mesh=mesh, shard_placement_fn=lambda _, d=dim: Shard(d), **fsdp)
        moe.experts.set_gradient_divide_factor(float(divide_factor))
    return set()


def parallelize_experts(
    model: nn.Module, tp_mesh: DeviceMesh | None, ep_mesh: DeviceMesh | None, sequence_parallel: bool = False
) -> None:
    """The MoE layers' share of `parallelize`: experts over ep, the rest replicated over tp."""
    if ep_mesh is not None:
        apply_expert_parallel(model, ep_mesh)
    if tp_mesh is not None:
        for moe in moe_layers([model]):
            tensor_parallel_moe(moe, tp_mesh, ep_mesh is not None, sequence_parallel)
