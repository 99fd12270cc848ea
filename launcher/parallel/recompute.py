"""Activation checkpointing, per transformer block: `recompute=none|selective|full`.

- full: a block keeps only its input; backward re-runs its forward (Chen et al. 2016). Saves
  the most memory, costs one more forward of every block.
- selective: a block keeps the outputs of its expensive ops (matmuls, attention, and the
  reduce-scatter of sequence parallelism) and recomputes the cheap ones (norms, activations,
  rotary embeddings, elementwise ops) - in the spirit of Korthikanti et al. 2022, as a
  torch.utils.checkpoint selective-checkpoint policy.

The block's `forward` is wrapped in place (no wrapper module), so parameter names do not change.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from launcher.compat import attention_and_reduce_scatter_ops

SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    *attention_and_reduce_scatter_ops(),
}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def _checkpointed(forward: Any, selective: bool, *args: Any) -> Any:
    extra = {"context_fn": _selective_contexts} if selective else {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra)


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of `model` (a whole model or a pipeline stage) in place."""
    if mode == "none":
        return
    for block in model.layers.values():
        block.forward = functools.partial(_checkpointed, block.forward, mode == "selective")
