"""Step time: compute, tensor-parallel communication, pipeline bubble and point-to-point, and the
data-parallel communication left exposed after overlap. One efficiency model for every machine.

Compute runs at peak x matmul_efficiency (one number per machine, in its hardware profile) x the
efficiency of the GEMMs at their per-device shapes / (1 + H0 g / h):
- GEMM shapes: a block's weight matmuls multiply (tokens x K) by (K x N) with K or N divided by the
  tensor-parallel degree (the QKV and MLP-in outputs, the output-projection and MLP-out inputs). A
  GEMM whose narrow side d = min(K, N, tokens) is small fills the device's tiles and waves worse and
  re-reads its operands more per FLOP: it runs at 1 / (1 + G0 / d) of a wide one. The block's
  GEMMs are weighted by their FLOPs (time adds up), so tp = 8 on a narrow model (h 4096: K = 512 on
  the output projection) is slower per FLOP than on a wide one.
- The work that is not matmul (norms, activations, softmax, residuals, optimizer) grows like h per
  token while matmul work grows like h^2, so its share falls like 1/h; H0 is the width at which
  both would take equal time. That work is bound by memory bandwidth and the matmuls by FLOP/s, so
  H0 = NONMATMUL x (peak FLOP/s / memory bytes/s) with one NONMATMUL for every accelerator (an
  H100 does 295 FLOP per byte, an A100 153: the same model loses more to its elementwise work on
  an H100). Without sequence parallelism TP leaves a share (REPLICATED) of that work undivided, so
  per device it weighs g = 1 + REPLICATED (t - 1) times more.
- Unfused attention (memory.FUSED_ATTENTION off: Megatron before FlashAttention) also streams the
  a x s score matrix of every token through memory: UNFUSED_PASSES reads and writes of it forward
  and backward (softmax, and dropout with its 1-byte mask), one more forward under full recompute.
FLOPs are the hardware FLOPs of `flops.py` (recompute included).

Recompute: a block recomputed in full costs 4/3 of its FLOPs (flops.py); selective recompute
repeats no matmul, only the block's forward non-matmul work (a third of its non-matmul time).

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
and in a MoE block only the attention half (the block compiles around its routed FFN). On a
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

from dataclasses import dataclass

from launcher.config import ModelConfig
from launcher.flops import flops_per_token, hardware_flops_per_token, head_dim, kv_heads, loss_weight_bytes
from launcher.layout import Layout, async_tp_applies
from launcher.planner import comm, memory, moe
from launcher.planner.device import Machine
from launcher.planner.memory import GRAD_BYTES, counts, full_layers, rank_layers, rank_params, recomputed_layers

# Model width at which the non-matmul work takes as long as the matmuls. It scales with the device's
# FLOP/byte ratio: accelerators (~150-300 FLOP per byte of memory traffic) share one value, set by the
# published runs; a CPU (~5-10) does far less elementwise work per FLOP: two blocks of `small` (h 256)
# at 2 x 256 tokens, forward + backward in one process and 1 thread, take 47.0 ms (best of 25) beside
# 1024^3 GEMMs at 197 GFLOP/s: less the calibrated host time of 2 blocks (1.4 ms), 5.26 GFLOP at 0.59
# of the GEMM rate, 1/(1 + 180/256). The attention kernel (SDPA on CPU: ~100 GFLOP/s) is part of it.
H0 = {"cuda": 1024.0, "tpu": 1024.0, "cpu": 180.0}  # without a memory bandwidth in the profile
NONMATMUL = 4.0  # H0 per FLOP/byte of the device (612 on an A100, 1184 on an H100): fitted, docs/planner.md
# element passes over the score matrix: forward softmax (read, write), backward (read the gradient
# and the probabilities, write); with dropout forward (read, write) and backward (read, write) too
UNFUSED_PASSES = {"softmax_fwd": 2, "softmax_bwd": 3, "dropout_fwd": 2, "dropout_bwd": 2}
# GEMM narrow side at which a GEMM runs at half the speed of a wide one (accelerators: 128 x 128 or
# 256 x 128 output tiles per SM, so a side of a few hundred already wastes a share of each wave);
# fitted on the published runs; on a CPU not measured, so 0 (the calibrated GEMM peak alone, as before)
G0 = {"cuda": 64.0, "tpu": 64.0, "cpu": 0.0}
REPLICATED = 0.15  # share of the non-matmul work that TP leaves replicated without sequence parallelism
# Input + weight backward over a full backward, torch 2.13 on this CPU (`python -m bench split_backward`:
# torch's stage_backward_input and stage_backward_weight on the small model's 2-block stage, micro 2 x 256,
# 1 thread, best of 20, side by side with one backward): 19.4 + 9.9 ms vs 26.2 ms. The fused projections'
# input and weight gradients are separate autograd nodes (launcher/model/transformer.py), so each pass runs
# only its own GEMMs; what remains is torch's graph walk and hooks, and the elementwise backward (norms,
# RoPE) the input pass runs in full. (With one node for both, the input pass computed nearly a whole
# backward and the weight pass repeated those GEMMs: 27.7 + 15.6 ms vs 26.8 ms, 1.61.) On an accelerator
# the host work overlaps the kernels and the split costs what one backward does (no factor).
SPLIT_BACKWARD_CPU = 1.12
CONTENTION = {"cuda": 0.2, "tpu": 0.2, "cpu": 1.0}  # share of overlapped communication still taken from compute


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the busiest rank, by component."""

    compute: float  # forward + backward (+ recompute) of all microbatches
    tp_comm: float
    cp_comm: float  # K/V all-gathers and their gradients' reduce-scatters
    tp_host: float  # DTensor dispatch the device does not hide (cpu)
    pp_p2p: float
    pp_bubble: float
    dp_exposed: float  # data-parallel communication not hidden behind compute
    dp_total: float  # all data-parallel communication, hidden or not
    tp_level: str
    cp_level: str
    dp_level: str
    pp_level: str
    ep_comm: float = 0.0  # MoE all-to-alls (launcher/planner/moe.py)
    ep_level: str = ""
    host: float = 0.0  # every block's framework dispatch the device does not hide, MoE routing's copies (cpu)
    optimizer: float = 0.0  # the optimizer step over the rank's parameters (cpu)
    loss: float = 0.0  # the chunked loss's output-weight traffic (`loss_traffic`)

    @property
    def total(self) -> float:
        comm = self.tp_comm + self.cp_comm + self.tp_host + self.pp_p2p + self.dp_exposed + self.ep_comm
        return self.compute + self.host + comm + self.pp_bubble + self.optimizer + self.loss

    def as_dict(self) -> dict[str, float]:
        keys = ("compute", "host", "tp_comm", "cp_comm", "tp_host", "pp_p2p", "pp_bubble", "dp_exposed", "dp_total")
        keys += ("ep_comm", "optimizer", "loss")
        out = {k: getattr(self, k) for k in keys}
        out["total"] = self.total
        return out


def gemm_efficiency(m: ModelConfig, tp: int, tokens: int, g0: float) -> float:
    """The block's weight GEMMs at their per-device shapes, FLOP-weighted, relative to wide GEMMs."""
    h, t = m.dim, tp
    hq, hkv = m.n_heads * head_dim(m), kv_heads(m) * head_dim(m)
    mlp_in = (2 if m.mlp == "swiglu" else 1) * m.ffn_dim
    shapes = ((h, (hq + 2 * hkv) / t), (hq / t, h), (h, mlp_in / t), (m.ffn_dim / t, h))  # (K, N)
    flops = [k * n for k, n in shapes]
    time = [k * n * (1.0 + g0 / min(k, n, tokens)) for k, n in shapes]
    return sum(flops) / sum(time)


def nonmatmul_width(machine: Machine) -> float:
    """H0: the model width at which the work that is not matmul takes as long as the matmuls."""
    if machine.memory_bandwidth:
        return NONMATMUL * machine.flop_per_byte
    return H0.get(machine.kind, H0["cuda"])


def non_matmul_share(machine: Machine, m: ModelConfig, layout: Layout) -> float:
    """Time of the non-matmul work relative to the matmul work (H0 g / h, the module docstring)."""
    t = layout.tp
    spread = 1.0 if layout.sequence_parallel or t == 1 else 1.0 + REPLICATED * (t - 1)
    return nonmatmul_width(machine) * spread / m.dim


def compute_efficiency(machine: Machine, m: ModelConfig, layout: Layout, tokens: int) -> float:
    """Achieved share of peak for this model and layout, `tokens` per microbatch (see the module docstring)."""
    gemm = gemm_efficiency(m, layout.tp, tokens, G0.get(machine.kind, G0["cuda"]))
    return machine.matmul_efficiency * gemm / (1.0 + non_matmul_share(machine, m, layout))


def unfused_attention_seconds(m: ModelConfig, seq: int, layout: Layout, machine: Machine, elem: int) -> float:
    """Seconds per token and layer of one device streaming the score matrix (0 when attention is fused)."""
    if memory.FUSED_ATTENTION or not machine.memory_bandwidth:
        return 0.0
    p = UNFUSED_PASSES
    fwd = p["softmax_fwd"] * elem + (p["dropout_fwd"] * elem + 1 if m.dropout > 0 else 0)
    bwd = p["softmax_bwd"] * elem + (p["dropout_bwd"] * elem + 1 if m.dropout > 0 else 0)
    passes = fwd * (2 if layout.recompute == "full" else 1) + bwd
    return m.n_heads / layout.tp * seq * passes / machine.memory_bandwidth


def loss_traffic(m: ModelConfig, layout: Layout, machine: Machine, tokens: int) -> float:
    """Seconds per microbatch of the chunked loss (pp = 1, tp = 1) moving the output weight and its fp32
    gradient sum once per chunk (flops.loss_weight_bytes, at the runtime's chunk size) at the memory
    bandwidth, none of it hidden behind the matmuls. The logits' own elementwise passes scale with
    tokens, as in the unchunked loss: the non-matmul share. A profile without a memory bandwidth (cpu)
    counts none: this CPU's chunks (docs/planner.md) moved theirs in 3-4% of the loss's time."""
    if not memory.chunked_loss(layout) or not machine.memory_bandwidth:
        return 0.0
    return loss_weight_bytes(tokens, m.vocab_size, m.dim, machine.flop_per_byte) / machine.memory_bandwidth


def _exposed(comm_s: float, window: float, buckets: int, contention: float) -> float:
    """Seconds of `comm_s` left on the critical path when it overlaps `window` seconds of compute."""
    tail = comm_s / max(1, buckets)
    hideable = comm_s - tail
    return tail + max(hideable - window, 0.0) + contention * min(hideable, window)


def step_time(
    m: ModelConfig, seq: int, layout: Layout, machine: Machine, elem: int, async_tp: bool = False
) -> StepTime:
    lv = machine.levels
    t, p, v, mb, cp = layout.tp, layout.pp, layout.chunks, layout.microbatches, layout.cp
    tokens = layout.micro * seq // cp  # this rank's share of the microbatch
    f_model = flops_per_token(m, seq)
    f_hw = hardware_flops_per_token(m, seq, recomputed_layers(m.n_layers, layout))
    f_out = 6.0 * counts(m).output_matmul
    f_layer = (f_model - f_out) / m.n_layers  # without recompute; a fully recomputed block: x 4/3
    layers = rank_layers(m.n_layers, p, v, layout.v_shape)
    last = layout.last_rank
    full = [full_layers(m.n_layers, layout, r) for r in range(p)]
    # with ep > 1 the busiest ep rank's experts route rank_imbalance x the mean rows: their extra FLOPs are
    # spread over the rank's blocks (a fully recomputed one repeats its forward, as for the rest)
    work = [
        (n + full[r] / 3.0) * (f_layer + moe.extra_routed_flops(m, layout, r) / max(1, n))
        + (f_out if r == last else 0.0)
        for r, n in enumerate(layers)
    ]
    # selective recompute repeats a block's forward non-matmul work: a third of its non-matmul time
    share = non_matmul_share(machine, m, layout)
    sel = [(n - full[r]) * share / 3.0 if layout.recompute == "selective" else 0.0 for r, n in enumerate(layers)]
    work = [w + sel[r] * f_layer / (1.0 + share) for r, w in enumerate(work)]
    flop_rate = machine.peak_flops * compute_efficiency(machine, m, layout, tokens)
    # the slowest rank sets the pipeline's pace: its compute and, with MoE, its all-to-alls (a rank
    # holding the dense layers or the output may compute most yet exchange least)
    a2a = [moe.all_to_all_time(m, layout, lv, tokens, elem, r) for r in range(p)]
    busiest = max(range(p), key=lambda r: tokens * work[r] / (t * flop_rate) + a2a[r])
    t_comp = tokens * work[busiest] / (t * flop_rate)
    t_comp += tokens * layers[busiest] * unfused_attention_seconds(m, seq, layout, machine, elem)
    if layout.zero_bubble and machine.kind == "cpu":  # the host is the device: torch's split costs show
        t_comp *= 1 + (SPLIT_BACKWARD_CPU - 1) * (f_hw - f_model / 3.0) / f_hw

    act_bytes = tokens * m.dim * elem
    # a fully recomputed block repeats its forward all-reduces; selective saves the collectives' outputs
    # (sequence parallelism: it re-gathers the inputs of the two column-parallel groups, half the bytes)
    sp_regather = 1.0 if layout.recompute == "selective" and layout.sequence_parallel else 0.0
    ends = (busiest == 0) + (busiest == last)  # embedding forward, output backward
    n, k = layers[busiest], full[busiest]
    all_reduces = 4 * n + 2 * k + sp_regather * (n - k) + ends
    t_tp = t_host = 0.0
    blocks_run = layers[busiest] + ends / 2  # the embedding and the output with the loss weigh half a block each
    t_block = machine.block_overhead * blocks_run
    t_block += moe.host_copies(m, layout, machine, tokens, elem, busiest, GRAD_BYTES)
    c = CONTENTION.get(machine.kind, CONTENTION["cuda"])
    if t > 1:
        blocks = (all_reduces - ends) * comm.all_reduce(lv, act_bytes, 1, t)
        if async_tp_applies(layout, async_tp):  # chunked around the matmuls where compiled (the docstring)
            fused = blocks * (1.0 - moe.rank_moe_layers(m, layout, busiest) / (2.0 * max(1, n)))
            blocks = _exposed(fused, t_comp, t, c) + blocks - fused
        t_tp = blocks + ends * comm.all_reduce(lv, act_bytes, 1, t)
        t_tp += 3 * comm.all_reduce(lv, tokens * 4.0, 1, t) if busiest == last else 0.0
        t_host = machine.host_overhead * blocks_run
    t_cp = 0.0
    if cp > 1:
        kv_bytes = layout.micro * seq * 2 * kv_heads(m) * head_dim(m) / t * elem  # gathered K and V
        gathers = 2 if layout.recompute == "full" else 1
        per_layer_cp = gathers * comm.all_gather(lv, kv_bytes, t, cp) + comm.reduce_scatter(lv, kv_bytes, t, cp)
        t_cp = layers[busiest] * per_layer_cp
    t_p2p = 2 * v * comm.send(lv, act_bytes / t, t * cp * layout.dp) if p > 1 else 0.0
    t_a2a = a2a[busiest]
    slot = t_comp + t_block + t_tp + t_cp + t_host + t_p2p + t_a2a

    # data parallel: parameters of the busiest rank, over the dp_shard then dp_replicate groups
    params = rank_params(m, layout, busiest)
    bwd = t_comp * (f_hw - f_model / 3.0) / f_hw
    fwd = t_comp - bwd
    buckets = max(1, layers[busiest])
    s, rep = layout.fsdp_shard, layout.dp_replicate
    experts = moe.rank_expert_params(m, layout, busiest)  # whole, before FSDP shards them over edp
    dp_total = dp_exposed = 0.0
    if s > 1:  # + the experts' own FSDP units over edp (ep > 1; ep divides dp_shard, so s > 1)
        e_gather, e_scatter, e_cross = moe.expert_fsdp_comm(m, layout, lv, busiest, elem, GRAD_BYTES)

        def copies(kind: str, per_param: int) -> float:  # the rank's FSDP units, then its experts' over edp
            own = fsdp_copies(machine, per_param * params, s, kind)
            return own + fsdp_copies(machine, per_param * experts, layout.edp, kind)

        gather = comm.all_gather(lv, elem * params, t, s, buckets) + e_gather + copies("gather", elem)
        scatter = comm.reduce_scatter(lv, GRAD_BYTES * params, t, s, buckets) + e_scatter
        scatter += copies("scatter", GRAD_BYTES)
        cross = (comm.all_reduce(lv, GRAD_BYTES * params / s, t * s, rep, buckets) if rep > 1 else 0.0) + e_cross
        if p == 1 and not layout.reshard_after_forward:  # ZeRO-2: one gather per microbatch, kept for backward
            dp_total = mb * (gather + scatter) + cross
            dp_exposed = mb * _exposed(gather, fwd, buckets, c)
            dp_exposed += (mb - 1) * _exposed(scatter, bwd, buckets, c) + _exposed(scatter + cross, bwd, buckets, c)
        elif p == 1:  # ZeRO-3: gather for forward and again for backward, reduce-scatter every microbatch
            dp_total = mb * (2 * gather + scatter) + cross
            dp_exposed = mb * _exposed(gather, fwd, buckets, c)
            dp_exposed += (mb - 1) * _exposed(gather + scatter, bwd, buckets, c)
            dp_exposed += _exposed(gather + scatter + cross, bwd, buckets, c)  # HSDP: + replica all-reduce
        else:  # pipelining keeps the stage gathered: one gather, one reduce-scatter per step
            dp_total = gather + scatter + cross
            dp_exposed = _exposed(gather, fwd, buckets, c) + _exposed(scatter + cross, bwd, buckets, c)
    elif rep > 1:
        dp_total = comm.all_reduce(lv, GRAD_BYTES * params, t, rep)
        dp_exposed = _exposed(dp_total, bwd, buckets, c)
    # the optimizer updates the rank's FSDP shard, and its shard of its experts' own units (over edp)
    t_opt = machine.optimizer_time * (params / s + experts / layout.edp)

    return StepTime(
        compute=mb * t_comp,
        host=mb * t_block,
        optimizer=t_opt,
        tp_comm=mb * t_tp,
        cp_comm=mb * t_cp,
        tp_host=mb * t_host,
        pp_p2p=mb * t_p2p,
        pp_bubble=bubble_slots(layout) * slot,
        dp_exposed=dp_exposed,
        dp_total=dp_total,
        tp_level=_outer(machine, 1, t),
        cp_level=_outer(machine, t, cp),
        dp_level=_outer(machine, t, layout.dp * cp),
        pp_level=comm.level_of(lv, 2 * t * cp * layout.dp).name if p > 1 else "",
        ep_comm=mb * t_a2a,
        ep_level=moe.expert_level(lv, layout),
        loss=mb * loss_traffic(m, layout, machine, tokens),
    )


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
    its layers), as `planner.timeline` measures it on torch's action orders: (p - 1)/v for GPipe and
    the 1F1B family; a zero-bubble schedule fills all but one forward chunk per hop with weight
    gradients, (p - 1) chunk forwards = (p - 1)/(3v) slots with forward, input and weight gradient
    equally long (each one GEMM per weight); zbv with fewer than 2p - 1 microbatches cannot fill its
    warm-up, 2(2p - 1 - m) chunk forwards."""
    p, v, m = layout.pp, layout.chunks, layout.microbatches
    if p == 1:
        return 0.0
    if layout.schedule in ("interleaved_zb", "dualpipev"):
        return (p - 1) / (3 * v)
    if layout.schedule == "zbv":
        return max(p - 1, 2 * (2 * p - 1 - m)) / (3 * v)
    return (p - 1) / v


def _outer(machine: Machine, stride: int, size: int) -> str:
    parts = comm.split(machine.levels, stride, size)
    return parts[-1][0].name if parts else ""
