"""Pipeline parallelism: cut the layers into stages, run a `torch.distributed.pipelining` schedule.

Stages. With pp ranks and v virtual stages per rank there are S = pp * v stages; rank r holds the
stages r, r + pp, ..., r + (v - 1) * pp (the looped placement of interleaved 1F1B, Narayanan et al.
2021), or r and 2 pp - 1 - r in a V, as its schedule places them (`layout.rank_stages`). The
embeddings live on stage 0, the final norm, the output projection and the loss on stage S - 1.
Layers are split as evenly as possible (`layout.stage_layers`, which the planner counts with too):
when S does not divide n_layers, the first n_layers % S stages take one layer more (the last stage
already carries the output projection and the loss, the heaviest non-block work, so it is never the
one given the extra layer).

A stage is a copy of the (meta) `Transformer` with the parts it does not hold deleted, as torchtitan
cuts its stages: its blocks keep their global names (`layers.5`), so parameter names, and therefore
checkpoints, do not depend on the layout.

Schedules are the rows of launcher/layout/schedules.py: each names its placement, its rules and the
class that runs it (torch's own, `schedule_class`); `build_schedule` builds that class over this
rank's stages. Gradients are the mean over micro-batches (`scale_grads`). A zero-bubble schedule
splits each backward into the input gradient (I, which the previous stage waits for) and the weight
gradient (W, which nobody waits for): torch runs I as `autograd.grad` over the stage's inputs with
the graph retained, so a microbatch's saved activations live until its W (the planner counts them in
flight until then), and the fused projections' weight gradients get a node of their own
(`split_weight_passes`).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from launcher.compat.pipeline_compat import pipeline_stage
from launcher.layout import SCHEDULE, stage_layers
from launcher.model import Transformer
from launcher.model.moe import moe_layers
from launcher.ops.fused import FusedLinear, SplitFusedLinear
from launcher.parallel.swap import swap_modules


def schedule_class(schedule: str) -> type:
    """The class that runs `schedule`: its row's `runtime` (launcher/layout/schedules.py), imported here."""
    module, _, name = SCHEDULE[schedule].runtime.rpartition(".")
    return getattr(importlib.import_module(module), name)


def stage_module(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """Stage `stage`'s part of `model` (on meta: shapes only): a copy of its own, so that the stages of
    one rank (virtual stages) share no module, hook or buffer, without the parts other stages hold."""
    part = copy.deepcopy(model)
    held = {str(i) for i in stage_layers(model.cfg.n_layers, n_stages)[stage]}
    for name in [name for name in part.layers if name not in held]:
        del part.layers[name]
    if stage > 0:
        part.tok_embeddings = part.pos_embeddings = None
    if stage < n_stages - 1:
        part.norm = part.output = None
    return part


def split_weight_passes(model: nn.Module) -> None:
    """The fused projections of `model` give their weights' gradients in nodes of their own, for a
    zero-bubble schedule's separate input and weight passes; so do the routed experts (autograd's chain)."""
    swap_modules(model, FusedLinear, lambda _: SplitFusedLinear())
    for moe in moe_layers([model]):
        moe.experts.split_weights = True


def _owned(out: Any) -> Any:
    """`out`, copied if it is a view: a zero-bubble input backward detaches each stage output (and
    the loss) in place, which autograd refuses for views, and under TP those are `DTensor.to_local`
    views. A copy of one activation per microbatch; no copy where the output already owns its storage."""
    return out.clone() if isinstance(out, torch.Tensor) and out._is_view() else out


def _owned_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    return lambda logits, targets: _owned(loss_fn(logits, targets))


def build_schedule(
    modules: list[nn.Module],
    stages: list[int],
    n_stages: int,
    group: torch.distributed.ProcessGroup,
    device: torch.device,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The schedule object driving this rank's stages (step(x, target=, losses=) / eval(...))."""
    row, cls = SCHEDULE[schedule], schedule_class(schedule)
    if row.zero_bubble:
        for m in modules:
            m.register_forward_hook(lambda _module, _args, out: _owned(out))
        loss_fn = _owned_loss(loss_fn)
    pipe_stages = [pipeline_stage(m, s, n_stages, device, group) for m, s in zip(modules, stages)]
    if row.multi_stage:  # a list of this rank's stages (the V schedules place them themselves)
        return cls(pipe_stages, n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(pipe_stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
