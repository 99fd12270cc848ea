"""Activation checkpointing, per transformer block: `recompute=none|selective|full` and
`recompute_layers=N`.

- full: a block keeps only its input; backward re-runs its forward (Chen et al. 2016). Saves the
  most memory, costs one more forward of every block (+1/3 of its FLOPs).
- selective: an op-level policy (torch.utils.checkpoint's selective checkpoint API, as torchtitan's
  op-level SAC and Megatron's / MaxText's policies): a block keeps its input and the outputs of its
  weight matmuls, and recomputes everything else in backward - norms, activations, RoPE, residual
  adds, dropout (same RNG state). No matmul is repeated, so it costs no matmul FLOPs, only
  elementwise work. Two choices beyond "save the matmuls":
  * attention (SDPA, and FlexAttention's higher-order op under document masks on CUDA): its output
    and log-sum-exp are saved. Recomputing them would repeat the quadratic attention kernel (4 s h
    FLOPs per token forward, the block's costliest op at long sequences) to free one h_q-wide tensor;
    and attention's backward needs that output anyway.
  * tensor parallelism: a row-parallel matmul (input sharded on its contraction dimension) makes a
    partial sum that a collective completes; its output is recomputed and the collective's output
    (all-reduce, or sequence parallelism's reduce-scatter) saved instead, so recomputation never
    repeats an all-reduce or reduce-scatter and the partial sum is not stored twice.
- recompute_layers=N: the first N blocks of each stage (each model chunk under interleaving) are
  recomputed in full, the rest follow `recompute` (none or selective): Megatron's partial recompute,
  a step between no recompute and full recompute for a layout that needs a little memory.
- compiled under torch 2.13 only, full recompute keeps attention's output (one (batch, seq, heads x
  head_dim) tensor a block): that version's compiler fails on a tensor-parallel block whose recompute
  re-runs SDPA (launcher/compat/torch_compat.py `compiled_recompute_keeps_attention`). The same
  attention ops (`ATTENTION_OPS`) serve both policies, so a document-masked block keeps flex's output
  there too.

The block's `forward` is wrapped in place (no wrapper module), so parameter names do not change.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from launcher.compat.torch_compat import (
    attention_and_collective_ops,
    attention_ops,
    compiled_recompute_keeps_attention,
    flex_attention_ops,
)
from launcher.layout import Layout

aten = torch.ops.aten
MATMULS = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0}  # op → index of its input
ATTENTION_OPS = attention_ops() | flex_attention_ops()  # SDPA's kernels and, under document masks, flex's
SAVE_OPS = attention_and_collective_ops() | ATTENTION_OPS


def _partial_sum(op: Any, args: tuple) -> bool:
    """A row-parallel matmul: its input is sharded on the contraction (last) dimension, so the output
    is a partial sum that a collective finishes (and that collective's output is saved)."""
    x = args[MATMULS[op]]
    return isinstance(x, DTensor) and any(p.is_shard(x.ndim - 1) for p in x.placements)


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective recompute's policy over ops (see the module docstring)."""
    if op in MATMULS and not _partial_sum(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Full recompute but for attention's output (torch 2.13 compiled: `compiled_recompute_keeps_attention`)."""
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.MUST_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(policy)


def _full_contexts() -> Any:
    return create_selective_checkpoint_contexts(keep_attention)


def _checkpointed(forward: Any, selective: bool, *args: Any) -> Any:
    if selective:
        extra = {"context_fn": _selective_contexts}
    elif torch.compiler.is_compiling() and compiled_recompute_keeps_attention():
        extra = {"context_fn": _full_contexts}
    else:
        extra = {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra)


def block_modes(n_blocks: int, layout: Layout) -> list[str]:
    """The recompute of each block of a stage, in order: the first `recompute_layers` in full."""
    full = layout.full_layers(n_blocks)
    return ["full"] * full + [layout.recompute] * (n_blocks - full)


def apply_recompute(model: nn.Module, layout: Layout) -> None:
    """Checkpoint the blocks of `model` (a whole model or a pipeline stage) in place."""
    blocks = list(model.layers.values())
    for block, mode in zip(blocks, block_modes(len(blocks), layout)):
        if mode != "none":
            block.forward = functools.partial(_checkpointed, block.forward, mode == "selective")
