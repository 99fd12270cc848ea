"""Compute time: the pipeline rank that sets the step's pace, and its seconds of forward and backward
per microbatch.

Compute: the hardware FLOPs of `flops.py` (recompute included) at the layout's share of peak
(launcher/planner/efficiency.py). Unfused attention (`fused_attention=False`: Megatron before
FlashAttention) also streams the a x s score matrix of every token through memory: UNFUSED_PASSES
reads and writes of it forward and backward (softmax, and dropout with its 1-byte mask), one more
forward under full recompute.

Recompute: a block recomputed in full costs 4/3 of its FLOPs (flops.py); selective recompute
repeats no matmul, only the block's forward non-matmul work (a third of its non-matmul time).

The busiest rank is the slowest at its compute and, with MoE, its all-to-alls; the other components
of the step (launcher/planner/cost.py) are timed on that rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.model import ModelConfig
from launcher.hardware.machine import Machine
from launcher.layout import Layout
from launcher.planner import eager, moe
from launcher.planner.efficiency import compute_efficiency, non_matmul_share
from launcher.planner.fp8 import Fp8, matmul_saving
from launcher.planner.memo import flops_per_token, hardware_flops_per_token, on_fields
from launcher.planner.memory import counts, full_layers, rank_layers, rank_params, ranks_full, recomputed_layers

# element passes over the score matrix: forward softmax (read, write), backward (read the gradient
# and the probabilities, write); with dropout forward (read, write) and backward (read, write) too
UNFUSED_PASSES = {"softmax_fwd": 2, "softmax_bwd": 3, "dropout_fwd": 2, "dropout_bwd": 2}
# Input + weight backward over a full backward, torch 2.13 on this CPU (`python -m bench split_backward`:
# torch's stage_backward_input and stage_backward_weight on the small model's 2-block stage, micro 2 x 256,
# 1 thread, best of 20, side by side with one backward): 19.4 + 9.9 ms vs 26.2 ms. The fused projections'
# input and weight gradients are separate autograd nodes (launcher/model/transformer.py), so each pass runs
# only its own GEMMs; what remains is torch's graph walk and hooks, and the elementwise backward (norms,
# RoPE) the input pass runs in full. (With one node for both, the input pass computed nearly a whole
# backward and the weight pass repeated those GEMMs: 27.7 + 15.6 ms vs 26.8 ms, 1.61.) On an accelerator
# the host work overlaps the kernels and the split costs what one backward does (no factor).
SPLIT_BACKWARD_CPU = 1.12


@dataclass(frozen=True)
class Pace:
    """The pipeline rank that sets the step's pace, per microbatch: what every other component reads."""

    rank: int
    tokens: int  # its share of the microbatch (seq / cp tokens of each sequence)
    activation_bytes: int  # one block boundary's activations: tokens x h in the compute dtype
    layers: int  # blocks it holds
    full: int  # of which recomputed in full
    ends: int  # the embedding's forward (first rank) and the output's backward (last rank) it runs
    params: int  # its parameters before FSDP shards them, routed experts apart when ep > 1
    experts: int  # its routed experts' parameters when ep > 1 (their own FSDP units over edp)
    compute: float  # seconds of forward + backward (+ recompute)
    backward: float  # of which backward
    all_to_all: float  # MoE all-to-alls

    @property
    def forward(self) -> float:
        return self.compute - self.backward

    @property
    def blocks_run(self) -> float:
        return self.layers + self.ends / 2  # the embedding and the output with the loss weigh half a block each


def unfused_attention_seconds(m: ModelConfig, seq: int, layout: Layout, machine: Machine, elem: int) -> float:
    """Seconds per token and layer of one device streaming the score matrix of unfused attention (0
    where the profile gives no memory bandwidth)."""
    if not machine.memory_bandwidth:
        return 0.0
    p = UNFUSED_PASSES
    fwd = p["softmax_fwd"] * elem + (p["dropout_fwd"] * elem + 1 if m.dropout > 0 else 0)
    bwd = p["softmax_bwd"] * elem + (p["dropout_bwd"] * elem + 1 if m.dropout > 0 else 0)
    passes = fwd * (2 if layout.recompute == "full" else 1) + bwd
    return m.n_heads / layout.tp * seq * passes / machine.memory_bandwidth


@on_fields("tp", "pp", "chunks", "v_shape", "last_rank", "ep", "sequence_parallel", "recompute", "recompute_layers")
def rank_work(m: ModelConfig, seq: float, layout: Layout, machine: Machine) -> list[float]:
    """FLOPs per token of each pipeline rank (attention over `seq` keys per query): its blocks (a fully
    recomputed one repeats its forward: x 4/3), the output on the last rank, and selective recompute's
    repeated non-matmul work (a third of a block's non-matmul time) as the FLOPs that would take as long."""
    f_model = flops_per_token(m, seq)
    f_out = 6.0 * counts(m).output_matmul
    f_layer = (f_model - f_out) / m.n_layers  # without recompute
    layers = rank_layers(m.n_layers, layout.pp, layout.chunks, layout.v_shape)
    full = ranks_full(m.n_layers, layout)
    # with ep > 1 the busiest ep rank's experts route rank_imbalance x the mean rows: their extra FLOPs are
    # spread over the rank's blocks (a fully recomputed one repeats its forward, as for the rest)
    work = [
        (n + full[r] / 3.0) * (f_layer + moe.extra_routed_flops(m, layout, r) / max(1, n))
        + (f_out if r == layout.last_rank else 0.0)
        for r, n in enumerate(layers)
    ]
    share = non_matmul_share(machine, m, layout)
    sel = [(n - full[r]) * share / 3.0 if layout.recompute == "selective" else 0.0 for r, n in enumerate(layers)]
    return [w + sel[r] * f_layer / (1.0 + share) for r, w in enumerate(work)]


def pace(
    m: ModelConfig,
    seq: int,
    layout: Layout,
    machine: Machine,
    elem: int,
    fused_attention: bool,
    compiled: bool = True,
    fp8: Fp8 | None = None,
    span: float = 0.0,
) -> Pace:
    """The slowest pipeline rank at its compute and, with MoE, its all-to-alls (a rank holding the
    dense layers or the output may compute most yet exchange least): it sets the pipeline's pace.
    An eager block (not `compiled`, or under a zero-bubble schedule, which the runtime leaves eager)
    also pays its unfused pointwise passes (launcher/planner/eager.py); under `fp8` the converted
    layers' matmuls run faster (launcher/planner/fp8.py). Attention's FLOPs follow `span` keys per
    query under document masking (flops.document_span; 0: the whole sequence)."""
    t, p = layout.tp, layout.pp
    tokens = layout.micro * seq // layout.cp
    attended = span or seq
    work = rank_work(m, attended, layout, machine)
    flop_rate = machine.peak_flops * compute_efficiency(machine, m, layout, tokens)
    a2a = (
        [moe.all_to_all_time(m, layout, machine.levels, tokens, elem, r) for r in range(p)]
        if layout.ep > 1
        else [0.0] * p
    )
    times = [tokens * w / (t * flop_rate) for w in work]
    slots = [c + a for c, a in zip(times, a2a, strict=True)]
    busiest = slots.index(max(slots))  # the first of the slowest
    layers = rank_layers(m.n_layers, p, layout.chunks, layout.v_shape)[busiest]
    compute = times[busiest]
    full = full_layers(m.n_layers, layout, busiest)
    if fp8 is not None:  # the matmul-only rate: compute_efficiency less the non-matmul work
        rate = t * flop_rate * (1.0 + non_matmul_share(machine, m, layout))
        compute -= matmul_saving(fp8, m, t, tokens, layers + full / 3.0, rate)
    if not fused_attention:
        compute += tokens * layers * unfused_attention_seconds(m, seq, layout, machine, elem)
    compiled = compiled and not layout.zero_bubble
    compute += tokens * layers * eager.pointwise_seconds(m, layout, machine.memory_bandwidth, elem, compiled)
    if machine.kind != "cpu":  # the host launches every kernel; the cpu's host time is calibrated apart
        compute = max(compute, layers * eager.launch_seconds(m, layout, compiled))
    f_model = flops_per_token(m, attended)
    f_hw = hardware_flops_per_token(m, attended, recomputed_layers(m.n_layers, layout))
    if layout.zero_bubble and machine.kind == "cpu":  # the host is the device: torch's split costs show
        compute *= 1 + (SPLIT_BACKWARD_CPU - 1) * (f_hw - f_model / 3.0) / f_hw
    return Pace(
        rank=busiest,
        tokens=tokens,
        activation_bytes=tokens * m.dim * elem,
        layers=layers,
        full=full,
        ends=(busiest == 0) + (busiest == layout.last_rank),
        params=rank_params(m, layout, busiest),
        experts=moe.rank_expert_params(m, layout, busiest),  # whole, before FSDP shards them over edp
        compute=compute,
        backward=compute * (f_hw - f_model / 3.0) / f_hw,
        all_to_all=a2a[busiest],
    )
