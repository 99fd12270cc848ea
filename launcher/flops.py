"""Parameter and FLOP counts: the one source for the MFU meter and the planner (no torch here).

Conventions (as in PaLM, Chowdhery et al. 2022, appendix B):
- Training FLOPs per token = 6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len.
- N_matmul counts the weights that take part in matrix multiplies: every projection of every block
  (q, k, v with their GQA widths, o, and the MLP: three matrices for SwiGLU, two for GELU) and the
  output projection. The input embedding is a lookup, not a matmul, so it is excluded; with tied
  embeddings the shared matrix is counted once, as the output projection. Norms, biases and learned
  positions are excluded (negligible, and not matmul FLOPs).
- Attention scores (QK^T) and the weighted sum (AV) cost 2 * 2 * seq * n_heads * head_dim per token
  and layer forward, x3 for forward + backward. Causal attention is counted in full (not halved),
  as PaLM does, so MFU stays comparable across implementations. Under document masking
  (data.document_mask) the seq_len of that term is the documents' span (`document_span`): the
  sum of squared document lengths over seq_len, not seq_len itself.
- Mixture of experts: a MoE layer's MLP is its router (E x dim), its routed experts and its shared
  experts (SwiGLU, 3 x dim x expert_ffn_dim each). Parameters count every expert; FLOPs count the
  *active* weights a token passes through: router, top_k routed and the shared experts.
- MFU uses model FLOPs: recomputation does not count. Hardware FLOPs (HFU, used by the planner to
  predict time) add one extra forward of the recomputed part.
- A device's FLOP per byte (peak FLOP/s over memory bandwidth) sets the chunked loss's chunk size,
  read by the runtime (ops/loss.py) and the planner alike: `loss_chunk_rows`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

GIB = float(2**30)  # bytes: hardware.memory_gib, and every memory the planner and the dry run report


class ModelShape(Protocol):
    """Anything with the architecture fields of `config.ModelConfig`."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None
    head_dim: int | None
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    norm: str
    norm_position: str
    mlp: str
    positions: str
    tied_embeddings: bool
    bias: bool
    moe: Any  # config.MoEConfig


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # token embedding (+ learned positions)
    per_layer: int  # one transformer block, all parameters (MoE: the mean over blocks)
    per_layer_matmul: int  # one block, matmul weights only (MoE: every expert; the mean over blocks)
    final_norm: int
    output: int  # untied output projection (0 when tied)
    output_matmul: int  # the logits matmul, counted even when tied
    layers: int = 0  # every block's parameters, exactly
    layers_active_matmul: int = 0  # matmul weights one token passes through in every block


def kv_heads(m: ModelShape) -> int:
    return m.n_kv_heads or m.n_heads


def head_dim(m: ModelShape) -> int:
    return m.head_dim or m.dim // m.n_heads


def norm_params(m: ModelShape) -> int:
    return m.dim * (2 if m.norm == "layernorm" else 1)


def expert_width(m: ModelShape) -> int:
    """Hidden width of one routed (or shared) expert."""
    return m.moe.expert_ffn_dim or m.ffn_dim


def expert_params(m: ModelShape) -> int:
    """Weights of one SwiGLU expert (3 matrices)."""
    return 3 * m.dim * expert_width(m)


def moe_layer_counts(m: ModelShape) -> tuple[int, int]:
    """(parameters, active matmul weights) of one MoE layer's MLP: router, routed and shared experts."""
    moe, expert = m.moe, expert_params(m)
    router = moe.experts * m.dim
    return router + (moe.experts + moe.shared_experts) * expert, router + (moe.top_k + moe.shared_experts) * expert


def moe_layer_count(m: ModelShape) -> int:
    return m.n_layers - m.moe.first_dense_layers if m.moe.experts else 0


def param_counts(m: ModelShape) -> ParamCounts:
    d, hd = m.dim, head_dim(m)
    q_out, kv_out = m.n_heads * hd, kv_heads(m) * hd
    attn = d * q_out + 2 * d * kv_out + q_out * d
    mlp_mats = 3 if m.mlp == "swiglu" else 2
    mlp = mlp_mats * d * m.ffn_dim
    matmul = attn + mlp
    biases = mlp_biases = 0
    if m.bias:
        mlp_biases = m.ffn_dim * (mlp_mats - 1) + d
        biases = q_out + 2 * kv_out + d + mlp_biases
    embedding = m.vocab_size * d + (m.max_seq_len * d if m.positions == "learned" else 0)
    final_norm = norm_params(m) if m.norm_position == "pre" else 0
    dense_layer = matmul + biases + 2 * norm_params(m)
    moe_total, moe_active = moe_layer_counts(m)
    n_moe = moe_layer_count(m)  # each replaces a dense MLP (with its biases) by a MoE one
    layers = m.n_layers * dense_layer + n_moe * (moe_total - mlp - mlp_biases)
    layers_matmul = m.n_layers * matmul + n_moe * (moe_total - mlp)
    return ParamCounts(
        embedding=embedding,
        per_layer=layers // m.n_layers,
        per_layer_matmul=layers_matmul // m.n_layers,
        final_norm=final_norm,
        output=0 if m.tied_embeddings else m.vocab_size * d,
        output_matmul=m.vocab_size * d,
        layers=layers,
        layers_active_matmul=m.n_layers * matmul + n_moe * (moe_active - mlp),
    )


def num_params(m: ModelShape) -> int:
    pc = param_counts(m)
    return pc.embedding + pc.layers + pc.final_norm + pc.output


def active_params(m: ModelShape) -> int:
    """Parameters one token uses: every non-expert parameter, and top_k routed + shared experts."""
    total, active = moe_layer_counts(m)
    return num_params(m) - moe_layer_count(m) * (total - active)


def attention_flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Forward + backward FLOPs of QK^T and AV for one token, all layers (full, not causal)."""
    return 12.0 * m.n_layers * m.n_heads * head_dim(m) * seq_len


def document_span(lengths: list[int], seq_len: int) -> float:
    """The attention span under document masking: what `seq_len` is to attention_flops_per_token
    when each token attends only within its document. A sequence's attention work is the sum of its
    documents' squared lengths (instead of seq_len^2), so a token of a document of length L counts
    min(L, seq_len) keys: the token-weighted mean of that over `lengths`. Documents cut by a sequence
    edge count whole (an upper bound: the cut makes the work smaller)."""
    tokens = sum(lengths)
    return sum(n * min(n, seq_len) for n in lengths) / tokens if tokens else float(seq_len)


def blocks_flops_per_token(m: ModelShape, seq_len: int) -> float:
    """FLOPs per token of all the blocks, forward + backward: the model's without the output projection."""
    return 6.0 * param_counts(m).layers_active_matmul + attention_flops_per_token(m, seq_len)


def flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), the numerator of MFU."""
    pc = param_counts(m)
    return 6.0 * (pc.layers_active_matmul + pc.output_matmul) + attention_flops_per_token(m, seq_len)


def hardware_flops_per_token(m: ModelShape, seq_len: int, recomputed_layers: float = 0) -> float:
    """FLOPs actually executed per token: model FLOPs plus the forward of the blocks recomputed in full
    (`recomputed_layers` of the n_layers: all under recompute=full, N per stage under recompute_layers).

    A fully recomputed block re-runs its forward: 1/3 of its FLOPs again. Selective recompute
    (launcher/parallel/recompute.py) keeps the outputs of the matmuls and of attention and re-runs only
    norms and elementwise ops, which are not matmul FLOPs: it adds nothing here (its time is the
    planner's, launcher/planner/compute.py).
    """
    base = flops_per_token(m, seq_len)
    if not recomputed_layers:
        return base
    return base + blocks_flops_per_token(m, seq_len) / 3.0 * recomputed_layers / m.n_layers


def mfu(tokens_per_s_per_device: float, model_flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak."""
    return tokens_per_s_per_device * model_flops_per_token / peak_flops if peak_flops > 0 else 0.0


# FLOP per byte the chunk rule assumes where a profile gives no memory bandwidth. Accelerators:
# planner/efficiency.py's H0 for them (1024) over NONMATMUL (4). cpu, chosen by measurement: it gives 410
# rows for 125m's 50304 x 768 output at 8 x 256 tokens, whose loss took 6.5-6.9 s of CPU time on one
# thread against 7.3-8.0 s in 16 MiB chunks (83 rows) and 6.4-6.8 s in 1024 rows (two runs).
FLOP_PER_BYTE = {"cuda": 256.0, "tpu": 256.0, "cpu": 45.0}
# The chunked loss (ops/loss.py) moves, for every chunk, each element of the output weight: read
# twice in the compute dtype (the logits, d loss / d h), the chunk's weight gradient written and read
# (bf16; fp32 adds it in place) and the fp32 sum read and written: 2+2 + 2+2 + 4+4 bytes in bf16,
# 4+4 + 4+4 in fp32; against 6 FLOPs per weight element and token of the chunk.
LOSS_WEIGHT_BYTES = 16
LOSS_TRAFFIC_SHARE = 0.25  # that traffic's time over the chunk's matmul time at peak, at most
LOSS_CHUNK_BYTES = 2**24  # the least chunk: 16 MiB of fp32 logits (small vocabularies: one chunk)


def device_flop_per_byte(kind: str, peak_tflops: float | None, memory_bandwidth_gbs: float | None) -> float:
    """Peak FLOP/s over memory bytes/s from a hardware profile's own numbers; FLOP_PER_BYTE[kind] where
    it gives either as null (the cpu profile calibrates its peak: the ratio never waits on a measurement)."""
    if peak_tflops is None or memory_bandwidth_gbs is None:
        return FLOP_PER_BYTE.get(kind, FLOP_PER_BYTE["cuda"])
    return (float(peak_tflops) * 1e12) / (memory_bandwidth_gbs * 1e9)


def loss_chunk_rows(tokens: int, vocab: int, flop_per_byte: float) -> int:
    """Tokens per chunk of the chunked loss: `tokens` split evenly into the fewest chunks of at most a
    target, the larger of 16 MiB of fp32 logits and the rows whose matmuls (6 x rows FLOPs per weight
    element) take 1 / LOSS_TRAFFIC_SHARE times as long at peak as moving the weight (LOSS_WEIGHT_BYTES
    per element). H200 (206 FLOP/B): 2198 rows, `1b` at 8 x 2048 tokens in 8 chunks of 2048, not 512 of
    32; `flop_per_byte` 0: the 16 MiB alone."""
    amortized = math.ceil(LOSS_WEIGHT_BYTES * flop_per_byte / (6 * LOSS_TRAFFIC_SHARE))
    target = max(1, LOSS_CHUNK_BYTES // (4 * vocab), amortized)
    chunks = -(-tokens // target)
    return -(-tokens // chunks)


def loss_weight_bytes(tokens: int, vocab: int, dim: int, flop_per_byte: float) -> float:
    """Bytes the chunked loss moves for the output weight over `tokens` tokens (one microbatch)."""
    chunks = -(-tokens // loss_chunk_rows(tokens, vocab, flop_per_byte))
    return float(chunks * LOSS_WEIGHT_BYTES * vocab * dim)
