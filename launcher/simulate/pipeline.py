"""A pipeline rank's stages stepped in its schedule's order, without torch's schedule object.

torch's schedule cannot run on the fake process group: before its first step it votes over P2P on how to
learn its stages' shapes and then receives the previous stage's shapes from it, and a fake group receives
nothing. So the rank's stages run here directly, in the order torch's schedule class gives this rank
(`schedule_actions`: the same action list the real run follows): F runs a stage on a microbatch (the
first stage on tokens, the others on a fake hidden state of the shape and dtype the previous stage
sends), B its whole backward (from the loss on the last stage, else from a fake gradient of its output),
I the same, W nothing (the input backward ran the weights' too: a zero-bubble split is not simulated).
FSDP units stay gathered, and their gradients unsynced, until a stage's last backward, as torch's
stage does (`set_requires_gradient_sync`, `set_reshard_after_backward`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from launcher.compat.fake_compat import forward_hooks
from launcher.compat.pipeline_compat import schedule_actions
from launcher.config.precision import fsdp_policy
from launcher.layout import SCHEDULE, Layout
from launcher.ops.experts import local
from launcher.parallel.pipeline import schedule_class
from launcher.parallel.runner import PipelineRunner, cross_entropy
from launcher.parallel.tensor import loss_context

# 1F1B's steady (backward, forward) pairs simulated: before each pair after the first the same shapes are live
# (the warmup's microbatches in flight, the gradients allocated), so every later pair repeats the second's
# memory exactly and is skipped; the cooldown's backwards (the last one reduces FSDP's gradients) all run
STEADY_PAIRS = 2


def rank_actions(layout: Layout, pp_rank: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, stage) in the order torch's schedule runs them on `pp_rank`: a multi-stage class's
    own action list; GPipe's and 1F1B's (one stage per rank, no list in torch) as their classes run them, but
    1F1B's steady state cut to `STEADY_PAIRS` pairs."""
    m = layout.microbatches
    if SCHEDULE[layout.schedule].multi_stage:
        stages = [layout.pp_stages(r) for r in range(layout.pp)]
        return schedule_actions(schedule_class(layout.schedule), layout.pp, stages, m)[pp_rank]
    # gpipe: every forward, then every backward; 1f1b: pp - r forwards, then one backward, one forward
    warmup = m if layout.schedule == "gpipe" else min(m, layout.pp - pp_rank)
    steady = min(m - warmup, STEADY_PAIRS)
    order = [("F", i) for i in range(warmup)]
    for i in range(steady):
        order += [("B", i), ("F", warmup + i)]
    order += [("B", i) for i in range(steady, steady + warmup)]
    return [(kind, i, pp_rank) for kind, i in order]


def hidden(layout: Layout, tokens: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fake hidden state as the previous stage sends it: local (micro, tokens, dim) of the rank's `tokens` of
    each sequence (its cp share), split over the tp ranks with sequence parallelism, in the compute dtype when FSDP
    gathers bf16 weights (the residual stream follows the weights), else fp32 (autocast keeps it)."""
    tokens //= layout.tp if layout.sequence_parallel else 1
    return torch.empty(layout.micro, tokens, dim, dtype=dtype, device=device, requires_grad=True)


def _sync(part: Any, last: bool) -> None:
    if isinstance(part, FSDPModule):
        part.set_requires_gradient_sync(last)
        part.set_reshard_after_backward(last)


@dataclass(frozen=True)
class RankStages:
    """What a pipeline rank's step reads besides its runner, taken before fake mode (a DeviceMesh sliced under
    fake mode computes its coordinates on fake tensors: the rank would find itself in no tp group)."""

    actions: list[tuple[str, int, int]]  # `rank_actions`
    stages: list[int]
    tp_mesh: Any
    dtype: torch.dtype  # of the hidden state between stages: bf16 where FSDP gathers bf16 weights, else fp32


def rank_stages(layout: Layout, pp_rank: int, actions: list, mesh: Any, precision: str) -> RankStages:
    dtype = torch.bfloat16 if fsdp_policy(precision) is not None else torch.float32
    return RankStages(actions, layout.pp_stages(pp_rank), mesh["tp"], dtype)


def step_stages(runner: PipelineRunner, layout: Layout, rank: RankStages, batch: tuple[torch.Tensor, ...]) -> None:
    """One training step of this rank's stages: each action of its schedule, in order."""
    parts, last_stage = dict(zip(rank.stages, runner.parts)), layout.stages - 1
    micro_in, micro_out = (t.split(layout.micro) for t in batch)
    backwards = {s: sum(1 for k, _, t in rank.actions if k in "BI" and t == s) for s in rank.stages}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    logits: dict[tuple[int, int], torch.Tensor] = {}  # the last stage's outputs, until their backward
    hooks: dict[tuple[int, int], list[Any]] = {}  # the tracker's, per forward (`forward_hooks`)
    done = dict.fromkeys(rank.stages, 0)
    with loss_context(layout.tp), runner.autocast or contextlib.nullcontext():
        for kind, mb, stage in rank.actions:
            part = parts[stage]
            if kind == "F":
                x = micro_in[mb]
                if stage > 0:  # as the previous stage sends it
                    x = hidden(layout, x.shape[1], part.cfg.dim, rank.dtype, x.device)
                with forward_hooks() as hooks[mb, stage]:
                    out = part(x)
                if stage == last_stage:  # torch's stage caches its output (the logits) until the backward
                    logits[mb, stage], out = out, _loss(rank, layout, out, micro_out[mb])
                outputs[mb, stage] = out
                del x, out  # held by the graph and the dicts alone, as the schedule holds them
            elif kind in "BI":
                done[stage] += 1
                _sync(part, done[stage] == backwards[stage])
                out = outputs.pop((mb, stage))
                out.backward(None if stage == last_stage else torch.empty_like(out))
                del out
                logits.pop((mb, stage), None)
                for handle in hooks.pop((mb, stage)):
                    handle.remove()


def _loss(rank: RankStages, layout: Layout, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The schedule's loss on the last stage: the vocabulary shards re-wrapped under tp (runner.py)."""
    if layout.tp > 1:
        logits = DTensor.from_local(logits, rank.tp_mesh, [Shard(-1)], run_check=False)
    return local(cross_entropy(logits, targets)) / layout.microbatches
