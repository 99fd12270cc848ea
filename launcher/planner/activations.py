"""Activations one transformer layer saves per token, by recompute policy and precision.

Activations per layer follow Korthikanti et al. 2022 (sbh(34 + 5as/h) bytes for GPT with fp16
activations and dropout), rebuilt term by term so that other shapes fit:
  replicated across TP ranks (divided by t only with sequence parallelism): the inputs of the two
  norms (2 tensors of h) and the two dropout masks (1 B each); the inputs of the QKV projection and of
  the MLP (2 tensors of h) are whole on every rank, all-gathered under sequence parallelism (each
  projection saves the gathered tensor: DTensor's plan, unlike Megatron's re-gather in backward);
  sharded by t: Q (h_q), K and V (h_kv each: GQA stores fewer), the output projection's input (h_q),
  the MLP's intermediates (GELU: input and output, 2f; SwiGLU: the gate|up product and silu(gate) x
  up, 3f, its node recomputing silu(gate): ops/pointwise.py; a MoE layer's routed experts gate and
  up, 2f (ops/experts.py), 4f under zero-bubble schedules); the attention core: the softmax output
  (a s elements), with dropout its mask and output; fused attention (SDPA's flash / memory-efficient
  kernels, as the runtime) stores none of these a s-sized tensors, only a log-sum-exp per head (fp32).
For GPT (f = 4h, h_q = h_kv = h, dropout, 2-byte activations) this gives exactly 10 + 24/t and
5as/(ht). Full recompute keeps each layer's input (2sbh, /t with sequence parallelism) and needs one
layer's full activations while it recomputes. Selective recompute (the op-level policy of
launcher/parallel/recompute.py) keeps the layer's input and the outputs of its matmuls and of
attention: Q, K, V, the attention output and its log-sum-exp, the MLP's up projections (SwiGLU 2f,
GELU f; all sharded), and the two row-parallel results (h each: all-reduced or reduce-scattered).
`recompute_layers=N` recomputes N blocks of each stage in full and the rest per the policy.
Under bf16 autocast (one process, pure TP, DDP: config/precision.py) the residual stream stays fp32: the norms
save their fp32 input and statistics, a projection its fp32 input unless tensor parallelism cast it first, and
RoPE its tables cast to bf16 in every block; recompute keeps the fp32 input (`stream_bytes`). Checked to the
byte against saved-tensor hooks, fp32 and autocast (tests/integration/test_planner_vs_runtime.py).
"""

from __future__ import annotations

from launcher.config.model import ModelConfig
from launcher.config.precision import precision_mode
from launcher.flops import expert_width, head_dim, kv_heads
from launcher.layout import Layout
from launcher.planner.memo import on_fields
from launcher.planner.moe import row_bytes

MASTER_BYTES = 4  # fp32: master weights (memory.py), and the residual stream under autocast


def norm_stats_bytes(m: ModelConfig, elem: int, fused_norm: bool = False) -> int:
    """Bytes per token that torch's eager norms save besides their input (Korthikanti et al. count the
    input only; measured against saved-tensor hooks in tests/integration/test_planner_vs_runtime.py): two norms per
    layer; RMSNorm saves x*rstd (h) and rstd where composed of ops (the CPU), its fp32 rstd alone as CUDA's fused
    kernel (`fused_norm`; launcher/simulate/kernels.py); LayerNorm mean and rstd."""
    if m.norm != "rmsnorm":
        return 2 * elem * 2
    return 2 * MASTER_BYTES if fused_norm else 2 * elem * (m.dim + 1)


def selective_bytes(m: ModelConfig, layout: Layout, elem: int, stream: int) -> float:
    """Saved bytes per token of one layer under the selective policy (see the module docstring)."""
    h, t, f = m.dim, layout.tp, m.ffn_dim
    hq, hkv = m.n_heads * head_dim(m), kv_heads(m) * head_dim(m)
    replicated = stream * h + 2 * elem * h  # the input and the two row-parallel results
    sharded = elem * (2 * hq + 2 * hkv + (2 if m.mlp == "swiglu" else 1) * f) + 4.0 * m.n_heads
    return (replicated / t if layout.sequence_parallel else replicated) + sharded / t


def stream_bytes(elem: int, kind: str, layout: Layout) -> int:
    """Bytes of an element of the residual stream: fp32 under autocast (precision_mode; the embedding's output
    is fp32 and only the matmuls cast), else the activations' `elem` (fp32 runs; FSDP's bf16 parameters)."""
    if kind == "tpu":  # no runtime here: XLA's bf16 training keeps its activations in bf16
        return elem
    dtype = "fp32" if elem >= MASTER_BYTES else "bf16"
    return MASTER_BYTES if precision_mode(dtype, kind, layout) == "autocast_bf16" else elem


@on_fields("tp", "cp", "sequence_parallel", "recompute", "zero_bubble")
def layer_activation_bytes(
    m: ModelConfig, seq: int, layout: Layout, elem: int, fused_attention: bool = True, stream: int = 0,
    fused_norm: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """(saved bytes per token of one layer under `layout.recompute`, bytes per token of one layer's
    full working set); `fused_attention`: SDPA's kernels, which the runtime calls (False: the score
    matrix stored, Megatron before FlashAttention); `stream`: `stream_bytes` (0: `elem`); `fused_norm`: CUDA's
    RMSNorm kernel (`norm_stats_bytes`). Under autocast the
    norms save their fp32 input and statistics, a projection its fp32 input where no tensor-parallel hook cast
    it first (tp = 1: launcher/parallel/tensor.py), and RoPE its tables cast to bf16 in every block."""
    stream = stream or elem
    h, t = m.dim, layout.tp
    mlp, routed = (3 if m.mlp == "swiglu" else 2) * m.ffn_dim, 0.0
    if m.moe.experts:  # a token's MLP: top_k routed + shared experts; its routed rows and routing
        experts = ((4 if layout.zero_bubble else 2) * m.moe.top_k + 3 * m.moe.shared_experts) * expert_width(m)
        # not split by tp (x t against the division below): the MoE layer runs whole on each tp rank
        mlp, routed = 0, (row_bytes(m, elem) + elem * experts) * t
    hq, hkv, a = m.n_heads * head_dim(m), kv_heads(m) * head_dim(m), m.n_heads
    mask = 1 if m.dropout > 0 else 0
    # the QKV and MLP projections' saved input: whole on every tp rank, all-gathered under sequence parallelism
    projected = 2 * (stream if t == 1 else elem) * h
    replicated = 2 * stream * h + 2 * mask * h + norm_stats_bytes(m, stream, fused_norm)
    rope = 2 * head_dim(m) * elem if stream != elem and m.positions == "rope" else 0  # cast (seq, head_dim) x 2
    # attention saves K and V as its core reads them: all-gathered over the cp ranks (cp x the local ones);
    # under cp each local chunk's output is saved, and their concatenation (the output projection's input)
    cp_out = hq if layout.cp > 1 else 0
    sharded = elem * (2 * hq + cp_out + 2 * hkv * layout.cp + mlp) + routed
    if fused_attention:
        core = 4.0 * a
    else:
        core = elem * a * seq + mask * (1 + elem) * a * seq
    rep = replicated / t if layout.sequence_parallel else replicated
    full = rep + projected + (sharded + core) / t + rope
    if layout.recompute == "full":
        return input_bytes(m, layout, stream), full
    if layout.recompute == "selective":
        return selective_bytes(m, layout, elem, stream), full
    return full, full


def input_bytes(m: ModelConfig, layout: Layout, stream: int) -> float:
    """Saved bytes per token of a layer recomputed in full: its input (split by tp with sequence parallelism), an
    element of the residual stream `stream` bytes."""
    return stream * m.dim / layout.tp if layout.sequence_parallel else stream * m.dim
