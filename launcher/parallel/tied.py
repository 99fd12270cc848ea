"""Tied embeddings across pipeline stages, as Megatron's PTD-P trains them (Narayanan et al. 2021).

With pp = 1 the output projection and the token embedding are one parameter. With pp > 1 the first
stage holds the embedding and the last stage a copy as its output weight (`stage_module` keeps the
output's weight): both start from the embedding's values (launcher/model/init.py draws the copy
under the embedding's name), and once per step, after the backward and before clipping, the two
gradients are summed, so both copies take the same optimizer update and stay equal bit for bit
(AdamW is elementwise, and x + y = y + x exactly). The gradient norm counts the matrix once (the
runner leaves the output copy out), and checkpoints name the copy as the one-process model does
(launcher/train/model_view.py), so they reshard between pp = 1 and pp > 1.

The sum runs in a group of the two ranks holding the copies, one group per (dp, cp, tp) coordinate,
as Megatron's embedding group: the middle stages take no part (an all-reduce over the whole pipeline
group with zeros from them would be exact too, but moves 2 (pp - 1) / pp shards per rank instead of
one, and needs the shard's shape on ranks that hold none). With pp = 2 that group is the pipeline
group. Gradients are summed as each rank holds them: under FSDP both copies are sharded alike (same
shape, same placements, same (dp, cp, tp) coordinate), so the local shards line up. The V schedules
(zbv, dualpipev: rank 0 holds both copies) are refused (launcher/layout/rules.py): the two copies
would be two parameters of one rank under one checkpoint name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.layout import Layout
from launcher.ops.experts import local


def tied_copies(parts: list[nn.Module]) -> list[nn.Parameter]:
    """This rank's copy of a tied matrix split over pipeline stages: the first stage's embedding or
    the last stage's output weight (none in a middle stage); [] when the model is untied, or whole
    here (one shared parameter)."""
    if not parts[0].cfg.tied_embeddings:
        return []
    found = [part.tok_embeddings.weight for part in parts if part.tok_embeddings is not None]
    found += [part.output.weight for part in parts if part.output is not None]
    return found if len({id(p) for p in found}) == len(found) else []


def output_copies(parts: list[nn.Module]) -> set[int]:
    """ids of the last stage's copy of a tied embedding (the gradient norm counts the embedding's)."""
    copies = tied_copies(parts)
    return {id(part.output.weight) for part in parts if copies and part.output is not None}


def tie_group(layout: Layout, mesh: Any) -> dist.ProcessGroup | None:
    """This rank's group of the two ranks holding the copies (None in a middle stage). Every rank
    creates every pair's group, in the mesh's order, as `new_group` requires."""
    if layout.pp == 2:
        return mesh.get_group("pp")
    columns = mesh.mesh.reshape(layout.pp, -1).T  # pp is the mesh's outermost dimension
    group, _ = dist.new_subgroups_by_enumeration([[int(c[0]), int(c[-1])] for c in columns])
    return group


@torch.no_grad()
def sum_tied_grads(copies: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """The copy's gradient becomes the sum of both (the module docstring); a no-op without one. Each
    gradient first takes its parameter's placements: the vocabulary-parallel embedding's comes back
    replicated under TP, the output's sharded (Replicate to Shard is a local slice)."""
    for p in copies:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        dist.all_reduce(local(p.grad), group=group)
