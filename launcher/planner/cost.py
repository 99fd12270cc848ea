"""Step time: compute, tensor-parallel communication, pipeline bubble and point-to-point, and the
data-parallel communication left exposed after overlap, one function per component; `step_time`
adds them up for the busiest pipeline rank (launcher/planner/compute.py: its compute time, and what
the other components read of it).

Tensor parallelism: 4 all-reduces of b s h activations per layer and microbatch (2 forward, 2
backward; with sequence parallelism the same bytes as all-gather + reduce-scatter), 2 more in a
block that full recompute repeats (1 under selective recompute with sequence parallelism: it
re-gathers the two column-parallel inputs), one for the vocabulary-parallel embedding (forward) and one for the
output projection (backward) on the stages that hold them, and 3 small ones of b s floats for the
vocabulary-parallel loss (max, sum of exponentials, target logit). None of it overlaps compute,
except under async TP (`async_tp`: compile + sequence parallel on CUDA; `layout.async_tp_applies`)
where torch splits each compiled block's all-gather / reduce-scatter into t chunks around its matmul:
the first chunk of each stays exposed, the rest hides behind the block's compute at the usual
CONTENTION. Only compiled code is fused: none under a zero-bubble schedule (its blocks run eager),
and in a MoE block only the attention half (the block compiles around its routed FFN); and only a
gather whose result a matmul reads as its left operand: selective recompute's re-gathers feed the
weights' gradients (x^T g, the right operand) and stay exposed (tests/unit/test_compile.py checks
that the gathers move bf16, the matmul's dtype, with no cast between them). On a
CPU the host is the device, so DTensor's dispatch (the machine's calibrated host_overhead per block
and microbatch) adds to the step too; accelerators run ahead of the host and hide it.

Host time where the host is the device (cpu profile, each calibrated; 0 on accelerators): every
block's framework dispatch per microbatch (block_overhead: the ends weigh half a block each), and
the optimizer step over the rank's parameters (optimizer_time per parameter), and FSDP's copies
around each all-gather and reduce-scatter (host_copy_time per byte, `fsdp_copies`). The cpu
profile's matmul efficiency is the GEMM rate sustained with every core busy over the peak.

Context parallelism: each rank computes seq / cp tokens of every sequence; per layer and microbatch
it all-gathers K and V of the whole sequence over the cp group (2 b s h_kv / t elements) before its
attention (again when full recompute repeats the forward) and reduce-scatters their gradients in
backward, on the link level the cp group spans (stride t: cp sits just outside tp); the runtime
does not overlap them. FSDP shards over dp_shard x cp.

Pipeline: every microbatch crosses each stage boundary forward and backward
(b s h / t bytes: scatter-gather or sequence parallel); the bubble is (p - 1)/v microbatch slots of
the busiest rank (GPipe and 1F1B: v = 1). Data parallel: gradients are reduced in fp32, FSDP gathers
weights in the compute dtype; the traffic overlaps the compute it can hide behind (the backward of
the last microbatch for gradients, each microbatch's forward/backward for ZeRO-3 gathers) except the
last bucket (one layer's share), and overlapped traffic still costs CONTENTION of its time (the
collective kernels take SMs and memory bandwidth from the matmuls; on a CPU gloo's copies and
reductions run on the cores the matmuls use, so nothing is hidden).
"""

from __future__ import annotations

from launcher.config.model import ModelConfig
from launcher.config.prediction import StepTime
from launcher.flops import head_dim, kv_heads, loss_weight_bytes
from launcher.hardware.machine import Level, Machine
from launcher.layout import Layout, async_tp_applies
from launcher.planner import comm, memory, moe
from launcher.planner.compute import Pace, pace
from launcher.planner.fp8 import Fp8, cast_seconds, gathered_saving
from launcher.planner.memo import on_fields
from launcher.planner.memory import GRAD_BYTES

CONTENTION = {"cuda": 0.2, "tpu": 0.2, "cpu": 1.0}  # share of overlapped communication still taken from compute


def contention(machine: Machine) -> float:
    return CONTENTION.get(machine.kind, CONTENTION["cuda"])


def loss_traffic(m: ModelConfig, layout: Layout, machine: Machine, tokens: int) -> float:
    """Seconds per microbatch of the chunked loss (pp = 1) moving the output weight (this rank's vocabulary
    shard under tp) and its fp32 gradient sum once per chunk (flops.loss_weight_bytes, at the runtime's
    chunk size) at the memory bandwidth, none of it hidden behind the matmuls. The logits' own
    elementwise passes scale with tokens, as in the unchunked loss: the non-matmul share. A profile
    without a memory bandwidth (cpu) counts none: this CPU's chunks (docs/planner.md) moved theirs in
    3-4% of the loss's time."""
    if not memory.chunked_loss(layout) or not machine.memory_bandwidth:
        return 0.0
    vocab = m.vocab_size // layout.tp
    return loss_weight_bytes(tokens, vocab, m.dim, machine.flop_per_byte) / machine.memory_bandwidth


def _exposed(comm_s: float, window: float, buckets: int, contention: float) -> float:
    """Seconds of `comm_s` left on the critical path when it overlaps `window` seconds of compute."""
    tail = comm_s / max(1, buckets)
    hideable = comm_s - tail
    return tail + max(hideable - window, 0.0) + contention * min(hideable, window)


def host_time(m: ModelConfig, layout: Layout, machine: Machine, busy: Pace, elem: int) -> float:
    """Host seconds per microbatch the device does not hide (cpu): every block's framework dispatch and
    MoE routing's copies."""
    t_block = machine.block_overhead * busy.blocks_run
    return t_block + moe.host_copies(m, layout, machine, busy.tokens, elem, busy.rank, GRAD_BYTES)


def tp_time(m: ModelConfig, layout: Layout, machine: Machine, busy: Pace, async_tp: bool) -> tuple[float, float]:
    """(communication, host dispatch) seconds per microbatch of tensor parallelism (the module docstring)."""
    t, lv = layout.tp, machine.levels
    if t == 1:
        return 0.0, 0.0
    # a fully recomputed block repeats its forward all-reduces; selective saves the collectives' outputs
    # (sequence parallelism: it re-gathers the inputs of the two column-parallel groups, half the bytes)
    sp_regather = 1.0 if layout.recompute == "selective" and layout.sequence_parallel else 0.0
    n, k, ends, act_bytes = busy.layers, busy.full, busy.ends, busy.activation_bytes
    one = comm.all_reduce(lv, act_bytes, 1, t)
    blocks, regathers = (4 * n + 2 * k) * one, sp_regather * (n - k) * one
    if async_tp_applies(layout, async_tp):  # chunked around the matmuls where compiled (the docstring)
        fused = blocks * (1.0 - moe.rank_moe_layers(m, layout, busy.rank) / (2.0 * max(1, n)))
        blocks = _exposed(fused, busy.compute, t, contention(machine)) + blocks - fused
    blocks += regathers  # feed the weights' gradients as the right operand: torch fuses a gathered left one
    comm_s = blocks + ends * comm.all_reduce(lv, act_bytes, 1, t)
    comm_s += 3 * comm.all_reduce(lv, busy.tokens * 4.0, 1, t) if busy.rank == layout.last_rank else 0.0
    return comm_s, machine.host_overhead * busy.blocks_run


def cp_time(m: ModelConfig, seq: int, layout: Layout, lv: tuple[Level, ...], busy: Pace, elem: int) -> float:
    """Seconds per microbatch of context parallelism's K/V all-gathers and gradient reduce-scatters."""
    t, cp = layout.tp, layout.cp
    if cp == 1:
        return 0.0
    kv_bytes = layout.micro * seq * 2 * kv_heads(m) * head_dim(m) / t * elem  # gathered K and V
    gathers = 2 if layout.recompute == "full" else 1
    per_layer = gathers * comm.all_gather(lv, kv_bytes, t, cp) + comm.reduce_scatter(lv, kv_bytes, t, cp)
    return busy.layers * per_layer


def p2p_time(layout: Layout, lv: tuple[Level, ...], busy: Pace) -> float:
    """Seconds per microbatch of the pipeline's sends, forward and backward, of each of its chunks."""
    if layout.pp == 1:
        return 0.0
    t = layout.tp
    return 2 * layout.chunks * comm.send(lv, busy.activation_bytes / t, t * layout.cp * layout.dp)


def fsdp_time(
    m: ModelConfig, layout: Layout, machine: Machine, busy: Pace, elem: int, fp8: Fp8 | None = None
) -> tuple[float, float]:
    """(all, exposed) seconds per step of FSDP: ZeRO-3 gathers for forward and again for backward, ZeRO-2
    once per microbatch, pipelining once per step; HSDP's replica all-reduce; and the experts' own FSDP
    units over edp (ep > 1: ep divides dp_shard; none over one rank, `moe.experts_in_fsdp`). `fp8`
    tensorwise gathers the converted weights in fp8."""
    lv, t, s, rep, mb = machine.levels, layout.tp, layout.fsdp_shard, layout.dp_replicate, layout.microbatches
    params, experts, buckets, c = busy.params, busy.experts, max(1, busy.layers), contention(machine)
    e_gather, e_scatter, e_cross = moe.expert_fsdp_comm(m, layout, lv, busy.rank, elem, GRAD_BYTES)
    expert_units = moe.experts_in_fsdp(layout)

    def copies(kind: str, per_param: int) -> float:  # the rank's FSDP units, then its experts' over edp
        own = fsdp_copies(machine, per_param * params, s, kind)
        return own + (fsdp_copies(machine, per_param * experts, layout.edp, kind) if expert_units else 0.0)

    gathered = elem * params - gathered_saving(fp8, m, layout, busy.layers, elem)
    gather = comm.all_gather(lv, gathered, t, s, buckets) + e_gather + copies("gather", elem)
    scatter = comm.reduce_scatter(lv, GRAD_BYTES * params, t, s, buckets) + e_scatter
    scatter += copies("scatter", GRAD_BYTES)
    cross = (comm.all_reduce(lv, GRAD_BYTES * params / s, t * s, rep, buckets) if rep > 1 else 0.0) + e_cross
    fwd, bwd = busy.forward, busy.backward
    if layout.pp > 1:  # pipelining keeps the stage gathered: one gather, one reduce-scatter per step
        return gather + scatter + cross, _exposed(gather, fwd, buckets, c) + _exposed(scatter + cross, bwd, buckets, c)
    if not layout.reshard_after_forward:  # ZeRO-2: one gather per microbatch, kept for backward
        exposed = mb * _exposed(gather, fwd, buckets, c)
        exposed += (mb - 1) * _exposed(scatter, bwd, buckets, c) + _exposed(scatter + cross, bwd, buckets, c)
        return mb * (gather + scatter) + cross, exposed
    # ZeRO-3: gather for forward and again for backward, reduce-scatter every microbatch
    exposed = mb * _exposed(gather, fwd, buckets, c)
    exposed += (mb - 1) * _exposed(gather + scatter, bwd, buckets, c)
    exposed += _exposed(gather + scatter + cross, bwd, buckets, c)  # HSDP: + replica all-reduce
    return mb * (2 * gather + scatter) + cross, exposed


def dp_time(
    m: ModelConfig, layout: Layout, machine: Machine, busy: Pace, elem: int, fp8: Fp8 | None = None
) -> tuple[float, float]:
    """(all, exposed) seconds per step of data-parallel communication for the busiest rank's parameters,
    over the dp_shard then the dp_replicate groups."""
    if layout.fsdp_shard > 1:
        return fsdp_time(m, layout, machine, busy, elem, fp8)
    if layout.dp_replicate == 1:
        return 0.0, 0.0
    total = comm.all_reduce(machine.levels, GRAD_BYTES * busy.params, layout.tp, layout.dp_replicate)
    return total, _exposed(total, busy.backward, max(1, busy.layers), contention(machine))


def tied_time(m: ModelConfig, layout: Layout, lv: tuple[Level, ...]) -> float:
    """Seconds per step of tied embeddings across pipeline stages: the first and the last stage
    all-reduce their copies' fp32 gradients (each rank its tp x FSDP shard) once, after the backward,
    with nothing to hide behind (launcher/parallel/tied.py): 2 ranks, (pp - 1) pipeline strides apart."""
    if layout.pp == 1 or not m.tied_embeddings:
        return 0.0
    shard = GRAD_BYTES * m.vocab_size * m.dim / (layout.tp * layout.fsdp_shard)
    return comm.all_reduce(lv, shard, (layout.pp - 1) * layout.tp * layout.cp * layout.dp, 2)


def optimizer_time(layout: Layout, machine: Machine, busy: Pace) -> float:
    """The optimizer updates the rank's FSDP shard, and its shard of its experts' own units (over edp)."""
    return machine.optimizer_time * (busy.params / layout.fsdp_shard + busy.experts / layout.edp)


def level_names(machine: Machine, layout: Layout) -> dict[str, str]:
    """The outermost link level each parallel group spans ("" where there is none)."""
    t, cp, lv = layout.tp, layout.cp, machine.levels
    return {
        "tp_level": _outer(machine, 1, t),
        "cp_level": _outer(machine, t, cp),
        "dp_level": _outer(machine, t, layout.dp * cp),
        "pp_level": comm.level_of(lv, 2 * t * cp * layout.dp).name if layout.pp > 1 else "",
        "ep_level": moe.expert_level(lv, layout),
    }


@on_fields(
    "tp", "pp", "cp", "micro", "chunks", "v_shape", "last_rank", "zero_bubble", "ep", "sequence_parallel", "recompute",
    "recompute_layers",
)  # fmt: skip
def microbatch_time(
    m: ModelConfig, seq: int, layout: Layout, machine: Machine, elem: int, async_tp: bool, fused_attention: bool,
    compiled: bool, fp8: Fp8 | None, span: float,
) -> tuple[Pace, float, float, float, float]:  # fmt: skip
    """The busiest rank (`pace`) and its seconds per microbatch of host dispatch (`host_time`), TP communication
    and dispatch (`tp_time`) and CP communication: what neither the batch split nor the data-parallel split
    changes, which the search shares between the layouts that differ in those alone."""
    busy = pace(m, seq, layout, machine, elem, fused_attention, compiled, fp8, span)
    t_tp, t_host = tp_time(m, layout, machine, busy, async_tp)
    t_cp = cp_time(m, seq, layout, machine.levels, busy, elem)
    return busy, host_time(m, layout, machine, busy, elem), t_tp, t_host, t_cp


def step_time(
    m: ModelConfig,
    seq: int,
    layout: Layout,
    machine: Machine,
    elem: int,
    async_tp: bool = False,
    fused_attention: bool = True,
    compiled: bool = True,
    fp8: Fp8 | None = None,
    span: float = 0.0,
    lower: bool = False,
) -> StepTime:
    """Seconds per optimizer step on the busiest rank, by component (the module docstring; `fp8`:
    launcher/planner/fp8.py; `span`: the attention span under document masking, 0: seq). `lower`: without the
    data-parallel traffic, the optimizer step, the tied embedding's all-reduce and the fp8 casts (each >= 0, so
    its total is no larger, rounding included): `lower_bound`."""
    args = (m, seq, layout, machine, elem, async_tp, fused_attention, compiled, fp8, span)
    busy, t_block, t_tp, t_host, t_cp = microbatch_time(*args)
    mb = layout.microbatches
    t_p2p = p2p_time(layout, machine.levels, busy)
    t_cast = (
        cast_seconds(fp8, m, layout, busy.tokens, busy.layers + busy.full / 3.0, machine.memory_bandwidth)
        if fp8 and not lower
        else 0.0
    )
    slot = busy.compute + t_block + t_tp + t_cp + t_host + t_p2p + busy.all_to_all + t_cast
    dp_total, dp_exposed = (0.0, 0.0) if lower else dp_time(m, layout, machine, busy, elem, fp8)
    return StepTime(
        compute=mb * busy.compute,
        host=mb * t_block,
        optimizer=0.0 if lower else optimizer_time(layout, machine, busy),
        tp_comm=mb * t_tp,
        cp_comm=mb * t_cp,
        tp_host=mb * t_host,
        pp_p2p=mb * t_p2p,
        pp_bubble=bubble_slots(layout) * slot,
        dp_exposed=dp_exposed,
        dp_total=dp_total,
        ep_comm=mb * busy.all_to_all,
        loss=mb * loss_traffic(m, layout, machine, busy.tokens),
        tied_comm=0.0 if lower else tied_time(m, layout, machine.levels),
        fp8_cast=mb * t_cast,
        **level_names(machine, layout),
    )


@on_fields(
    "tp", "pp", "cp", "micro", "chunks", "v_shape", "last_rank", "zero_bubble", "ep", "sequence_parallel", "recompute",
    "recompute_layers", "microbatches", "schedule", "dp",
)  # fmt: skip
def lower_bound(
    m: ModelConfig, seq: int, layout: Layout, machine: Machine, elem: int, async_tp: bool, fused_attention: bool,
    compiled: bool, fp8: Fp8 | None, span: float,
) -> float:  # fmt: skip
    """No more than `step_time(...).total`: `step_time(..., lower=True)`'s, which neither the data-parallel split
    nor the reshard choice changes (the search shares it between the layouts that differ in those alone)."""
    return step_time(m, seq, layout, machine, elem, async_tp, fused_attention, compiled, fp8, span, True).total


def fsdp_copies(machine: Machine, nbytes: float, ranks: int, kind: str) -> float:
    """Host seconds of the copies around one FSDP collective (`kind` gather or scatter) of an `nbytes`
    unit over `ranks`, torch 2.13's FSDP2: an all-gather copies the shard in and the whole out, a
    reduce-scatter the gradients in (chunk_cat) and its 1/ranks out, nbytes (1 + 1/ranks) each; over
    one rank there is no collective, and the gather is one copy of the whole, the scatter still two.
    0 where the profile has no host copy time (accelerators)."""
    if nbytes <= 0:
        return 0.0
    share = 1.0 if ranks == 1 and kind == "gather" else 1.0 + 1.0 / ranks
    return machine.host_copy_time * nbytes * share


def bubble_slots(layout: Layout) -> float:
    """Idle time of the busiest pipeline rank, in slots (one microbatch's forward and backward of all
    its layers): the schedule's `bubble` (launcher/layout/schedules.py)."""
    return layout.pipe.bubble(layout.pp, layout.chunks, layout.microbatches) if layout.pp > 1 else 0.0


def _outer(machine: Machine, stride: int, size: int) -> str:
    parts = comm.split(machine.levels, stride, size)
    return parts[-1][0].name if parts else ""
