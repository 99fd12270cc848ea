"""Memory per device: parameters, gradients, optimizer state, working buffers, activations, logits.

Precision (what the runtime does under bf16 autocast, and AdamW): fp32 parameters (4 B), fp32
gradients (4 B), two fp32 Adam moments (8 B), plus a working copy in the compute dtype (the autocast
weight cache, or FSDP's gathered bf16 layers). AdamW runs fused on CPU and CUDA (train/optim.py),
with no temporary per parameter. Sharding: FSDP/ZeRO-3 divides the fp32 state by dp_shard; with pp =
1 it gathers two blocks at a time (current + prefetched) in the compute dtype, and the root unit
(embeddings, final norm, output) is gathered for the output projection's backward, first of all,
while every activation is still held, beside the output's unsharded gradient and a block's gradient
with the fp32 copy FSDP reduce-scatters (measured: 125m FSDP dp=2 peaks at 1.96 GiB of RSS); with pp
> 1, torch.distributed.pipelining keeps the stage's parameters gathered and its gradients unsharded
from the first microbatch to the last (one gather and one reduce-scatter per step), which costs
compute-dtype + fp32 bytes for every parameter of the stage. ZeRO-2
(fsdp.reshard_after_forward=never, pp = 1) keeps every gathered layer from its forward to its
backward: the rank's parameters whole in the compute dtype at the end of forward. Under tensor
parallelism the vocabulary-parallel embedding's backward (DTensor's strategy for
`embedding_dense_backward`, torch 2.13) allocates the gradient of the whole (vocab x h) table in
the weight's dtype on every rank (the profiler shows the full-table `aten::zeros`: fp32, bf16 under
FSDP's bf16 policy), then keeps this rank's rows: (1 + 1/t) x vocab x h x 4 (or 2) bytes at the end
of the first rank's backward, when the activations are freed: the step's peak is the larger of the
two (peak RSS: 1.3-1.5x that table on 125m tp=2 and 1b tp=4, bench memory), counted with the
gradients. Fixed overhead per device: the CUDA context, NCCL's
buffers and cuBLAS workspaces on a GPU; on a CPU the worker process itself (Python, torch and the
launcher imported, a gloo group, what its first step allocates beside the tensors: 0.23-0.25 GiB beyond the
simulated tensors after two steps of `tiny`, 0.26-0.30 of `small`, resident memory less mapped files (the libraries'
pages: shared, and as many as the page cache makes them, metrics/meter.py), bench simulate_real).

Activations per layer and token: launcher/planner/activations.py.
Context parallelism (cp ranks, each seq / cp tokens of every sequence) divides everything per token
by cp, except K and V: attention saves the all-gathered K and V of the whole sequence (cp times the
local ones) and, beside its two chunks' outputs, their concatenation (one more h); on a CPU each
rank keeps the causal masks of its two chunks (c = seq / 2cp tokens) against the keys up to their
ends, c x (seq + c) in the compute dtype on all but cp rank 0 (a buffer; on accelerators the
flash kernel's causal flag needs none: launcher/parallel/context.py).
Document masks (data.document_mask): each forward of a microbatch (of a model chunk) builds its mask once and
its backward reads it: on a CPU a dense additive (micro, 1, seq, seq) tensor in the residual stream's dtype
(fp32: bf16 runs autocast there), on CUDA FlexAttention's block mask (kilobytes); with RoPE, the angles gathered
at each token's position in its document ((2, micro, seq, head_dim), fp32) too. Counted with the activations.
The busiest pipeline rank holds activations for the microbatches in flight: GPipe all m, 1F1B up to
p on the first rank (p - r on rank r), interleaved 1F1B 2(p - r - 1) + (v - 1)p + 1 chunks of 1/v of
its layers (p v + p - 1 on the first rank: Korthikanti's factor 1 + (p - 1)/(p v)).
"""

from __future__ import annotations

from functools import cache

from launcher.config.model import ModelConfig
from launcher.config.prediction import Memory
from launcher.flops import (
    FLOP_PER_BYTE,
    GIB,
    ParamCounts,
    head_dim,
    loss_chunk_rows,
    param_counts,
)
from launcher.layout import Layout, rank_stages, stage_layers, stage_size
from launcher.planner.activations import MASTER_BYTES, input_bytes, layer_activation_bytes, stream_bytes
from launcher.planner.memo import on_fields
from launcher.planner.moe import mean_routed_per_layer, rank_expert_params, rank_moe_layers, routed_params
from launcher.planner.timeline import in_flight, logits_in_flight

GRAD_BYTES = 4  # fp32 gradients
ADAM_BYTES = 8  # AdamW exp_avg + exp_avg_sq, fp32
LOG_SOFTMAX_BYTES = 4  # cross-entropy's fp32 log-softmax of the logits, saved for backward
LOSS_BACKWARD_BYTES = 8  # at a microbatch's loss backward: the log-softmax's gradient and the logits', fp32
OVERHEAD_GIB = {"cuda": 2.0, "tpu": 0.5, "cpu": 0.25}  # context, collective buffers, workspaces; cpu: the process
FLEX_BLOCK = 128  # FlexAttention's block mask: tokens per block side (create_block_mask's default)


@cache
def counts(m: ModelConfig) -> ParamCounts:
    """flops.param_counts, memoised on the model's fields (the search asks thousands of times)."""
    return param_counts(m)


@cache
def rank_layers(n_layers: int, pp: int, chunks: int, v_shape: bool = False) -> tuple[int, ...]:
    """Layers held by each pipeline rank: the runtime's stage split and placement."""
    split = stage_layers(n_layers, pp * chunks)
    return tuple(sum(len(split[s]) for s in rank_stages(r, pp, chunks, v_shape)) for r in range(pp))


@on_fields("tp", "pp", "chunks", "v_shape", "ep", "last_rank")
def rank_params(m: ModelConfig, layout: Layout, rank: int) -> int:
    """Parameters held by one device of pipeline rank `rank` (before FSDP sharding over dp_shard),
    routed experts excepted when ep > 1 (`moe.rank_expert_params`: their own FSDP units over edp).

    TP shards every projection and the vocabulary dimension of the embedding and output by t; norms
    and biases are counted as replicated. Learned positions live on the first rank. Tied embeddings
    with pp > 1: the last rank holds a copy of the embedding as its output weight (parallel/tied.py),
    counted as an untied output (with its gradient and optimizer state, which follow the parameters).
    """
    pc, t = counts(m), layout.tp
    n = rank_layers(m.n_layers, layout.pp, layout.chunks, layout.v_shape)[rank]
    experts = mean_routed_per_layer(m)  # MoE layers' routed experts run whole on every tp rank,
    pooled = experts if layout.ep == 1 else 0  # and with ep > 1 leave FSDP's pool
    total = n * ((pc.per_layer_matmul - experts) // t + pooled + pc.per_layer - pc.per_layer_matmul)
    if rank == 0:
        positions = m.max_seq_len * m.dim if m.positions == "learned" else 0
        total += (pc.embedding - positions) // t + positions
    if rank == layout.last_rank:
        total += pc.final_norm
        if not m.tied_embeddings or layout.pp > 1:
            total += pc.output_matmul // t
    return total


@on_fields("pp", "chunks", "v_shape", "recompute", "recompute_layers")
def ranks_full(n_layers: int, layout: Layout) -> tuple[int, ...]:
    """Blocks of each pipeline rank recomputed in full (`recompute_layers` of each of its stages)."""
    per_stage = [layout.full_layers(stage_size(n_layers, layout.stages, s)) for s in range(layout.stages)]
    return tuple(sum(per_stage[s] for s in layout.pp_stages(r)) for r in range(layout.pp))


def full_layers(n_layers: int, layout: Layout, rank: int) -> int:
    """Blocks of pipeline rank `rank` recomputed in full."""
    return ranks_full(n_layers, layout)[rank]


def recomputed_layers(n_layers: int, layout: Layout) -> int:
    """Blocks of the whole model recomputed in full (for flops.hardware_flops_per_token)."""
    return sum(ranks_full(n_layers, layout))


def chunked_loss(layout: Layout) -> bool:
    """The runtime's loss: chunked (ops/loss.py, each chunk's gradients computed in forward; under tp
    on each rank's vocabulary shard) without pipelining; else the schedule's loss over whole logits."""
    return layout.pp == 1


def loss_chunk_bytes(m: ModelConfig, tokens: int, elem: int, flop_per_byte: float, tp: int = 1) -> float:
    """The chunked loss's working set besides d loss / d h: a chunk's logits in fp32 (their vocabulary
    shard under `tp`), with (bf16) the matmul's output before it and the gradient fed back after it, each
    in the compute dtype; or that gradient beside the chunk's weight gradient before it joins the fp32 sum
    (bf16; fp32 adds in place). Rows per chunk: the runtime's rule, `flops.loss_chunk_rows`."""
    vocab = m.vocab_size // tp
    rows = loss_chunk_rows(tokens, vocab, flop_per_byte)
    low = elem if elem < MASTER_BYTES else 0
    return float(max(rows * vocab * (MASTER_BYTES + low), low * (rows * vocab + vocab * m.dim)))


def loss_bytes(m: ModelConfig, layout: Layout, elem: int, kind: str, tokens: int, flop_per_byte: float | None) -> float:
    """The last rank's loss working set for `tokens` per microbatch: with the chunked loss d loss / d h
    and one chunk's logits; else the logits of the microbatches in flight with their saved fp32 log-softmax
    (the fp32 upcast of bf16 logits is freed after forward), and at one microbatch's loss backward two fp32
    gradients of the same size (the simulation's peak of `1b` pp=2's last stage, which the real run matches)."""
    if chunked_loss(layout):
        ratio = FLOP_PER_BYTE.get(kind, FLOP_PER_BYTE["cuda"]) if flop_per_byte is None else flop_per_byte
        return tokens * m.dim * elem + loss_chunk_bytes(m, tokens, elem, ratio, layout.tp)
    per_token = (elem + LOG_SOFTMAX_BYTES) * logits_in_flight(layout) + LOSS_BACKWARD_BYTES
    return tokens * m.vocab_size / layout.tp * per_token


def memory(
    m: ModelConfig, seq: int, layout: Layout, elem: int, kind: str, flop_per_byte: float | None = None,
    fused_attention: bool = True, documents: bool = False,
) -> Memory:  # fmt: skip
    """Memory of the busiest device (the first or the last pipeline rank, the first on a tie); `flop_per_byte`:
    the device's (`Machine.flop_per_byte`, which sizes the chunked loss), by default its kind's; `documents`:
    under document masks (`document_bytes`)."""
    stream = stream_bytes(elem, kind, layout)
    state = ends_state(m, seq, layout, elem, kind)
    kept = ends_saved(m, seq, layout, elem, fused_attention, stream, kind)
    first = _parts(m, seq, layout, elem, kind, 0, flop_per_byte, state[0], kept[0], documents)
    if layout.pp == 1:
        return Memory(*first)
    last = _parts(m, seq, layout, elem, kind, layout.pp - 1, flop_per_byte, state[1], kept[1], documents)
    return Memory(*(last if sum(last) > sum(first) else first))  # Memory.total's sum (its `held` is 0)


def ends(layout: Layout) -> tuple[int, ...]:
    """The pipeline ranks one of which is the busiest: the first (the embedding) and the last (the loss)."""
    return (0,) if layout.pp == 1 else (0, layout.pp - 1)


def rank_saved(
    m: ModelConfig, seq: int, layout: Layout, elem: int, fused: bool, rank: int, stream: int = 0, kind: str = ""
) -> tuple[float, ...]:
    """Pipeline rank `rank`'s activations per token and microbatch in flight, whatever its batch split: (saved
    bytes of one of its layers on average, what backward rebuilds of one layer at a time, its blocks); on `kind`
    cuda RMSNorm is CUDA's fused kernel (`norm_stats_bytes`)."""
    layers = rank_layers(m.n_layers, layout.pp, layout.chunks, layout.v_shape)[rank]
    saved, working = layer_activation_bytes(m, seq, layout, elem, fused, stream or elem, kind == "cuda")
    full = full_layers(m.n_layers, layout, rank)
    # selective recompute rebuilds what a layer did not save (its norms' outputs, the activation function's)
    rebuilt = working - saved if layout.recompute == "selective" else 0.0
    if full:  # those blocks keep their input only; one of them at a time is rebuilt in backward
        saved = (saved * (layers - full) + input_bytes(m, layout, stream or elem) * full) / layers
        rebuilt = working
    return saved, rebuilt, layers


def embedding_table_bytes(m: ModelConfig, layout: Layout, stream: int) -> float:
    """Bytes the tensor-parallel embedding's backward adds beyond its rows' gradient in `rank_state` (docstring):
    the whole table's gradient, in the dtype of the weight it runs with (the residual stream's: bf16 under FSDP's
    policy, else fp32), beside this rank's rows; under a pipeline FSDP accumulates each microbatch's gradient
    unsynced, in fp32, as the DTensor the backward returns: the whole table, from the first microbatch's backward
    to the step's reduce-scatter (`to_accumulated_grad_if_needed`), where the rows alone were counted."""
    table, t = m.vocab_size * m.dim, layout.tp
    if layout.pp > 1 and layout.fsdp_shard > 1:
        return table * (stream + GRAD_BYTES * (1 - 1 / t))
    return table * stream * (1 + 1 / t)


def rank_state(m: ModelConfig, seq: int, layout: Layout, elem: int, kind: str, rank: int) -> tuple[float, float, float]:
    """What pipeline rank `rank` holds whatever its batch split and recompute choice (the search asks for
    each, `ends_state`): (its parameters' FSDP shard, gradient bytes but the embedding's whole-table one,
    buffer bytes)."""
    params = rank_params(m, layout, rank)
    s = layout.fsdp_shard
    layers = rank_layers(m.n_layers, layout.pp, layout.chunks, layout.v_shape)[rank]
    pc, routed = counts(m), mean_routed_per_layer(m)
    layer_params = (pc.per_layer_matmul - routed) // layout.tp + pc.per_layer - pc.per_layer_matmul
    # routed experts: at ep=1 in `params` (FSDP over s); at ep > 1 their own units, sharded over edp
    experts, edp = rank_expert_params(m, layout, rank), layout.edp
    block = layer_params + (routed_params(m) // layout.ep if rank_moe_layers(m, layout, rank) else 0)  # gathered
    if s > 1 and layout.pp > 1:  # gathered for the whole step, gradients unsharded until the end
        grads, buffers = GRAD_BYTES * (params + experts), elem * (params + experts)
    elif s > 1:  # ZeRO-3: the root unit and two blocks gathered (ZeRO-2: every block), at backward's start
        root = params - layers * (layer_params + (routed if layout.ep == 1 else 0))  # embeddings, final norm, output
        held = root + 2 * block if layout.reshard_after_forward else params + experts
        # + the output's unsharded gradient, a block's and its fp32 copy
        grads = GRAD_BYTES * (params / s + experts / edp)
        buffers = elem * held + elem * max(pc.output_matmul // layout.tp, block) + GRAD_BYTES * block
    else:
        grads, buffers = GRAD_BYTES * params, (elem * params if elem < MASTER_BYTES else 0)
    if layout.cp > 1 and kind == "cpu":  # the local chunks' causal masks, built once (flash needs none)
        chunk = seq // (2 * layout.cp)
        buffers += elem * chunk * (seq + chunk)
    return params / s + experts / edp, grads, buffers


@on_fields("tp", "pp", "chunks", "v_shape", "ep", "last_rank", "dp_shard", "cp", "reshard_after_forward")
def ends_state(m: ModelConfig, seq: int, layout: Layout, elem: int, kind: str) -> tuple[tuple[float, ...], ...]:
    """`rank_state` of each of the `ends` (one lookup for both: the search asks thousands of times)."""
    return tuple(rank_state(m, seq, layout, elem, kind, r) for r in ends(layout))


@on_fields("tp", "cp", "sequence_parallel", "recompute", "recompute_layers", "pp", "chunks", "v_shape", "zero_bubble")
def ends_saved(
    m: ModelConfig, seq: int, layout: Layout, elem: int, fused: bool, stream: int = 0, kind: str = ""
) -> tuple[tuple[float, ...], ...]:
    """`rank_saved` of each of the `ends`."""
    return tuple(rank_saved(m, seq, layout, elem, fused, r, stream, kind) for r in ends(layout))


def rank_memory(
    m: ModelConfig, seq: int, layout: Layout, elem: int, kind: str, rank: int, flop_per_byte: float | None = None,
    fused_attention: bool = True, documents: bool = False,
) -> Memory:  # fmt: skip
    stream = stream_bytes(elem, kind, layout)
    state = rank_state(m, seq, layout, elem, kind, rank)
    kept = rank_saved(m, seq, layout, elem, fused_attention, rank, stream, kind)
    return Memory(*_parts(m, seq, layout, elem, kind, rank, flop_per_byte, state, kept, documents))


def document_bytes(m: ModelConfig, seq: int, layout: Layout, kind: str, rank: int) -> float:
    """What document masks add on pipeline rank `rank` at its peak (module docstring), for each forward of a model
    chunk in flight (`in_flight` counts whole ranks' layers) of `layout.micro` sequences: the mask (on CUDA
    FlexAttention's block mask, eight int32 tensors over FLEX_BLOCK-token blocks, four of them n x n; elsewhere
    dense, fp32) and, with RoPE, its fp32 (2, head_dim) table gathered at each token's position in its document."""
    if kind == "cuda":
        blocks = -(-seq // FLEX_BLOCK)
        mask = 4 * 4 * blocks * (blocks + 1)
    else:
        mask = MASTER_BYTES * seq * seq
    rope = 2 * head_dim(m) * MASTER_BYTES * seq if m.positions == "rope" else 0
    return layout.micro * (mask + rope) * in_flight(layout, rank) * layout.chunks


def _parts(
    m: ModelConfig, seq: int, layout: Layout, elem: int, kind: str, rank: int, flop_per_byte: float | None,
    state: tuple[float, ...], kept: tuple[float, ...], documents: bool = False,
) -> tuple[float, ...]:  # fmt: skip
    """`rank_memory`'s parts (Memory's but `held`) from its `rank_state` and `rank_saved`."""
    (sharded, grads, buffers), (saved, rebuilt, layers) = state, kept
    tokens = layout.micro * seq // layout.cp  # this rank's share of each sequence
    acts = (saved * layers * in_flight(layout, rank) + rebuilt) * tokens
    if documents:
        acts += document_bytes(m, seq, layout, kind, rank)
    logits = loss_bytes(m, layout, elem, kind, tokens, flop_per_byte) if rank == layout.last_rank else 0.0
    table = 0.0  # tp: the embedding's whole-table gradient, last in backward (docstring)
    if layout.tp > 1 and rank == 0:
        table = embedding_table_bytes(m, layout, stream_bytes(elem, kind, layout))
    ddp = layout.dp_replicate > 1 and layout.fsdp_shard == 1  # its buckets hold the gradients from the start
    if layout.pp == 1 and layout.microbatches == 1 and not ddp:  # no gradient yet at forward's end; backward frees
        casts = buffers if layout.fsdp_shard == 1 else 0.0  # the activations (and autocast's weight casts: FSDP's
        grads = max(0.0, grads + table - (acts + logits + casts))  # gathered ones stay) as it writes them
    else:  # the table at the end of a microbatch's backward: that microbatch's activations are freed by then,
        grads += max(0.0, table - (acts / in_flight(layout, rank) + logits))  # the others' still in flight
    return MASTER_BYTES * sharded, grads, ADAM_BYTES * sharded, buffers, acts, logits, OVERHEAD_GIB.get(kind, 1.0) * GIB
