"""Tensor parallelism: the Megatron-LM cut of our transformer, written as a DTensor plan.

Per block (Shoeybi et al. 2019, fig. 3):
- attention split by heads: wq, wk, wv column-parallel (each rank computes n_heads / tp query heads
  and n_kv_heads / tp KV heads; the model infers head counts from the projected width), wo
  row-parallel: one all-reduce after attention;
- MLP: w1 (and the SwiGLU gate w3) column-parallel, w2 row-parallel: one all-reduce after the MLP;
- norms, dropout and residuals duplicated on every rank (no communication), or with
  `sequence_parallel` (Korthikanti et al. 2022) sharded over the sequence: the residual stream
  between blocks holds seq / tp positions per rank, and each all-reduce becomes an all-gather
  before the column-parallel layers plus a reduce-scatter after the row-parallel one.

Around the blocks: the token (and learned position) embedding is vocabulary-parallel (row-wise over
the table: each rank looks up its rows, a reduce forms the embedding), the output projection is
column-parallel over the vocabulary, and the loss is computed from vocabulary-sharded logits:
chunk by chunk with the output projection (parallel/vocab.py: per-token maxima and sums all-reduced),
or, where a pipeline stage returns its logits, under `loss_parallel()` (a distributed log-softmax); the
full (batch, seq, vocab) logits never exist on one rank.

Every parameter becomes a DTensor on the tensor-parallel mesh (duplicated ones as Replicate), so
optimizer and gradient-norm code never mixes plain tensors with DTensors. Weights are cut from the
full tensor every rank already holds (same seed), with no communication (`src_data_rank=None`).
Between modules tensors stay plain (local) tensors, which is also what pipeline stages send; the
fused projections (launcher/ops/fused.py) run on the local shards (`LocalFusedLinear`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from launcher.model.init import tied_output
from launcher.model.moe import MoE
from launcher.ops.fused import FusedLinear, autocast_input, converted
from launcher.ops.loss import OutputLoss
from launcher.parallel.swap import swap_modules
from launcher.parallel.vocab import VocabParallelLoss


class Duplicate(ParallelStyle):
    """Parameters replicated as DTensors; inputs and outputs stay local tensors (no communication).
    For norms without sequence parallelism: every rank computes the same thing."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                dist_param = nn.Parameter(distribute_tensor(param, mesh, [Replicate()], src_data_rank=None))
                mod.register_parameter(key, dist_param)

        def to_dtensor(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def to_local(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, partition, to_dtensor, to_local)


class LocalFusedLinear(nn.Module):
    """A `FusedLinear` over column-parallel layers (weights Shard(0), x a replicated DTensor), run on
    this rank's shards: the stack [q_r; k_r; v_r] is this rank's whole heads (hidden units) of each
    projection. x's gradient is then a partial sum, reduced once where the replicated input came
    from (the `PrepareModuleInput` of the plan: Megatron's "f")."""

    def __init__(self, fused: FusedLinear) -> None:
        super().__init__()
        self.fused = fused  # zero-bubble schedules swap it for their split one (parallel/pipeline.py)

    def forward(self, x: DTensor, *linears: nn.Linear) -> torch.Tensor:
        if converted(linears):  # float8 layers through their own ColwiseParallel hooks, on the DTensors
            return self.fused(x, *linears)
        weights = [lin.weight.to_local() for lin in linears]
        biases = [lin.bias.to_local() for lin in linears if lin.bias is not None]
        return self.fused.project(x.to_local(grad_placements=[Partial()]), weights, biases)


def local_fused(model: nn.Module) -> None:
    """Every `FusedLinear` of `model` on its layers' local shards. Also the MoE shared experts', which
    launcher/parallel/expert.py cuts the same way after this plan."""
    swap_modules(model, FusedLinear, LocalFusedLinear)


def plan(model: nn.Module, sequence_parallel: bool, local_logits: bool = False) -> dict[str, ParallelStyle]:
    """The plan for this rank's part of the model (pipeline stages hold some parts as None).
    `local_logits`: return the logits' vocabulary shard as a plain tensor (a pipeline stage's output)
    instead of a DTensor."""
    seq = Shard(1)  # (batch, seq, dim): the sequence dimension
    stream = seq if sequence_parallel else Replicate()  # layout of the residual stream
    norm = SequenceParallel(use_local_output=True) if sequence_parallel else Duplicate()
    styles: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        styles["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        if model.pos_embeddings is not None:  # a (seq, dim) table lookup: the sequence is dim 0
            styles["pos_embeddings"] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else Replicate()
            )
    for name in model.layers:
        block = f"layers.{name}."
        styles[block + "attention_norm"] = norm
        styles[block + "ffn_norm"] = norm
        # Megatron's "f": the half-block's input becomes one replicated DTensor (all-gathered first with
        # sequence parallelism), so the backward sums the input gradients of wq, wk, wv (w1, w3) and
        # reduces them once, instead of once per column-parallel projection
        styles[block + "attention"] = PrepareModuleInput(
            input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None)
        )
        styles[block + "feed_forward"] = PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),)
        )
        for proj in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            styles[block + proj] = ColwiseParallel()
        for proj in ("attention.wo", "feed_forward.w2"):
            styles[block + proj] = RowwiseParallel(output_layouts=stream)
        if isinstance(model.layers[name].feed_forward, MoE):  # whole on every tp rank (parallel/expert.py)
            for key in ("feed_forward", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
                del styles[block + key]
        elif model.layers[name].feed_forward.w3 is None:
            del styles[block + "feed_forward.w3"]
    if model.norm is not None:
        styles["norm"] = norm
    if model.output is not None:  # logits stay sharded over the vocabulary, as a DTensor
        styles["output"] = ColwiseParallel(
            input_layouts=stream, output_layouts=Shard(-1), use_local_output=local_logits
        )
    for style in styles.values():
        style.src_data_rank = None  # meta tensors: cut, nothing to scatter (launcher/model/init.py fills them)
    return styles


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, local_logits: bool = False
) -> None:
    """Shard `model` (a whole model or a pipeline stage) over the 1-D tensor-parallel mesh in place.
    Tied embeddings: the output projection shares the embedding's DTensor (both Shard(0) over the
    vocabulary)."""
    with tied_output(model):
        styles = plan(model, sequence_parallel, local_logits)
        # Under autocast the residual stream (and so a norm's output) is fp32 and each matmul casts its input:
        # the all-gather (sequence parallelism) or the backward's all-reduce would move fp32, twice the bytes,
        # with a cast between the gather and the matmul, where inductor's async-TP pass finds no pattern to
        # fuse. So each half-block's input is cast once, before the plan's own hook gathers (or reduces) it:
        # the same values, and the collectives move bf16. Registered first, not prepended later (torch 2.11's
        # compiler fails to guard a prepended hook's neighbour).
        for name, style in styles.items():
            if isinstance(style, PrepareModuleInput):
                model.get_submodule(name).register_forward_pre_hook(autocast_input)
        parallelize_module(model, mesh, styles)
    local_fused(model)
    if local_logits:
        # The last stage's logits are the view `to_local` returns, and FSDP2 warns (once, mid-output) that an
        # in-place op on a wrapped module's view would skip its pre-backward hook. The pipeline's loss reads them out
        # of place (`loss_context`); a clone to silence it would cost one more copy of the logits per microbatch.
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor", UserWarning)
    stream = Shard(1) if sequence_parallel else Replicate()
    swap_modules(model, OutputLoss, lambda _: VocabParallelLoss(mesh, stream))


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    """Around the loss and its backward: cross-entropy over vocabulary-sharded logits."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
