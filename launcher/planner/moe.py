"""What a mixture of experts adds to the planner (launcher/model/moe.py, launcher/parallel/expert.py).

- Memory: at ep=1 FSDP shards the routed experts with everything else. With ep > 1 each MoE layer's
  experts are an FSDP unit of their own: a rank's ep-local experts (1/ep of the layer's,
  `rank_expert_params`) sharded over the edp = dp_shard / ep ranks holding the same ones, so their
  weights, gradients and optimizer state divide by ep x edp = dp_shard; gathered whole (the ep-local
  part) per block like any FSDP unit. Under tensor parallelism a MoE layer runs whole on every tp rank.
- Compute: active FLOPs (flops.py); with ep > 1 the busiest ep rank receives `model.moe.rank_imbalance`
  times the mean of the routed rows (1.1 by default: bias balancing keeps the busiest *expert* near
  1.3-2 x the mean on moe_small, and an ep rank's experts/ep experts average most of that out), so its
  routed-expert FLOPs and the rows it sends grow by that factor, and its ep peers wait for it.
- Communication: four all-to-alls per MoE layer and microbatch (dispatch and combine, forward and
  backward), each rank sending its top_k copies of every token's hidden state, (ep - 1) / ep of it
  to other ranks, on the link levels the ep group spans (ep ranks spaced tp apart); they do not
  overlap compute here. The experts' FSDP traffic (`expert_fsdp_comm`): all-gathers and gradient
  reduce-scatters over edp (ranks spaced tp x ep apart), with the same schedule and overlap as the
  other FSDP units, and under HSDP an all-reduce of their shards over dp_replicate. Where that mesh is
  one rank (edp = 1, no dp_replicate) the experts have no FSDP unit and cost no copies (`experts_in_fsdp`).
- Host copies (`host_copies`, cpu): routing moves every routed row several times around the experts'
  matmuls, and under zero-bubble the expert loop's backward stacks their weight gradients; priced at the
  calibrated host copy rate, as FSDP's copies are (0 on accelerators, whose profiles have none).
"""

from __future__ import annotations

from launcher.config.model import ModelConfig
from launcher.flops import expert_params, moe_layer_count
from launcher.hardware.machine import Level, Machine
from launcher.layout import Layout, rank_stages, stage_layers
from launcher.planner import comm

# Copies of the routed (token, expert) rows per MoE layer and microbatch (launcher/model/moe.py `route`):
# forward, the gather into expert order, the experts' outputs joined, gated, added back per token;
# backward, the same four and the gates' gradient
ROW_PASSES = 9


def routed_params(m: ModelConfig) -> int:
    """Routed-expert weights of one MoE layer."""
    return m.moe.experts * expert_params(m)


def mean_routed_per_layer(m: ModelConfig) -> int:
    """Routed-expert weights per layer, averaged over all layers (as flops.ParamCounts averages)."""
    return moe_layer_count(m) * routed_params(m) // m.n_layers


def rank_moe_layers(m: ModelConfig, layout: Layout, rank: int) -> int:
    """MoE layers held by pipeline rank `rank` (its stages' layers after the leading dense ones)."""
    if not m.moe.experts:
        return 0
    split = stage_layers(m.n_layers, layout.stages)
    held = [i for s in rank_stages(rank, layout.pp, layout.chunks, layout.v_shape) for i in split[s]]
    return sum(i >= m.moe.first_dense_layers for i in held)


def rank_expert_params(m: ModelConfig, layout: Layout, rank: int) -> int:
    """Routed-expert weights in a rank's own expert FSDP units (ep > 1): its ep-local experts, whole,
    before FSDP shards them over edp; 0 at ep=1 (FSDP shards them with the rest)."""
    return rank_moe_layers(m, layout, rank) * routed_params(m) // layout.ep if layout.ep > 1 else 0


def experts_in_fsdp(layout: Layout) -> bool:
    """The experts have FSDP units of their own: ep > 1 and their mesh (edp x dp_replicate) has more than
    one rank; over one rank they stay out of FSDP (launcher/parallel/expert.py `shard_experts`)."""
    return layout.ep > 1 and layout.edp * layout.dp_replicate > 1


def expert_fsdp_comm(
    m: ModelConfig, layout: Layout, levels: tuple[Level, ...], rank: int, elem: int, grad_bytes: int
) -> tuple[float, float, float]:
    """Seconds of one all-gather (compute dtype) and one gradient reduce-scatter of pipeline rank
    `rank`'s expert units over edp, and of the HSDP all-reduce of their shards over dp_replicate."""
    experts = rank_expert_params(m, layout, rank)
    stride, edp = layout.tp * layout.ep, layout.edp  # edp sits just outside ep
    units = max(1, rank_moe_layers(m, layout, rank))  # one unit per MoE layer
    gather = comm.all_gather(levels, elem * experts, stride, edp, units)
    scatter = comm.reduce_scatter(levels, grad_bytes * experts, stride, edp, units)
    cross = comm.all_reduce(levels, grad_bytes * experts / edp, stride * edp, layout.dp_replicate, units)
    return gather, scatter, cross


def row_bytes(m: ModelConfig, elem: int) -> float:
    """Bytes per token a MoE layer saves for backward around its experts (launcher/model/moe.py,
    balance=bias): the token's k dispatched copies there and back (its rows in expert order, the experts'
    outputs); the router's fp32 scores (E); the picks' fp32 weights (k) and their sum; the gates (k, in
    the activations' dtype); three int64 vectors of k (the picks, their order by expert, their tokens)."""
    k = m.moe.top_k
    return 2.0 * elem * k * m.dim + 4 * m.moe.experts + (4 + elem + 3 * 8) * k + 4


def extra_routed_flops(m: ModelConfig, layout: Layout, rank: int) -> float:
    """FLOPs per token the busiest ep rank adds over the mean on pipeline rank `rank`: its MoE layers'
    routed experts at `rank_imbalance` x the mean rows (forward + backward, without recompute)."""
    if layout.ep == 1:
        return 0.0
    return (m.moe.rank_imbalance - 1.0) * 6.0 * m.moe.top_k * expert_params(m) * rank_moe_layers(m, layout, rank)


def host_copies(
    m: ModelConfig, layout: Layout, machine: Machine, tokens: int, elem: int, rank: int, grad_bytes: int
) -> float:
    """Host seconds of pipeline rank `rank`'s MoE layers' copies, one microbatch of `tokens` per rank:
    ROW_PASSES over the routed rows, and under a zero-bubble schedule the expert loop's backward stacking
    the weight gradients of its ep-local experts (the chain's `unbind` backward; elsewhere the loop is one
    node writing them in place)."""
    rows = ROW_PASSES * tokens * m.moe.top_k * m.dim * elem
    stacked = routed_params(m) // layout.ep * grad_bytes if layout.zero_bubble else 0
    return machine.host_copy_time * rank_moe_layers(m, layout, rank) * (rows + stacked)


def all_to_all_time(
    m: ModelConfig, layout: Layout, levels: tuple[Level, ...], tokens: int, elem: int, rank: int
) -> float:
    """Seconds of the four all-to-alls of every MoE layer of pipeline rank `rank`, one microbatch."""
    if layout.ep == 1:
        return 0.0
    sent = m.moe.rank_imbalance * tokens * m.moe.top_k * m.dim * elem  # the busiest rank's rows, all destinations
    return 4 * rank_moe_layers(m, layout, rank) * comm.all_to_all(levels, sent, layout.tp, layout.ep)


def expert_level(levels: tuple[Level, ...], layout: Layout) -> str:
    parts = comm.split(levels, layout.tp, layout.ep)
    return parts[-1][0].name if parts else ""
