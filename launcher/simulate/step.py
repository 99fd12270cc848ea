"""One rank of the layout built and stepped on fake tensors: its peak memory per category.

The worker's own pieces, in its order (launcher/train/setup.py, loop.py): the mesh, `build_runner`
(the meta model with the run's knobs, cut by `parallelize`), `build_optimizer`, then a step: forward/backward
over the rank's batch (a cp rank's share of each sequence), gradient clipping, the optimizer step (and float8's
scales precomputed for FSDP's float8 all-gather), zero_grad. The step measured is a second one:
AdamW allocates its moments in its first update, which runs first on zero gradients (the same update on the
same tensors: every parameter, its gradient and its moments live at once, as in a first step's update). A first
step's forward/backward holds less than the second's (no moments yet), so the peak over both is this one's, at
half the time: full-size pipelines run thousands of layer passes at ~0.1 s each on fake tensors.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from launcher.compat.fake_compat import StepTracker, fake_mode, forget_meshes, propagation_unseen, strict
from launcher.compat.torch_compat import fake_store
from launcher.config.options import BuildOptions
from launcher.config.run import Run
from launcher.layout import Layout, build_mesh, rank_of
from launcher.model.init import materialize
from launcher.parallel import build_runner
from launcher.parallel.float8 import precompute_scales
from launcher.parallel.runner import PipelineRunner, Runner
from launcher.simulate.kernels import cuda_kernels
from launcher.simulate.pipeline import RankStages, rank_actions, rank_stages, step_stages
from launcher.train.optim import build_optimizer

# torch's CPU build makes no fake CUDA tensors; a CUDA build makes them without a GPU, but its autograd engine asks
# the driver for the device's primary context in backward (docs/simulate.md)
DEVICE = "cpu"


def sim_options(options: BuildOptions) -> BuildOptions:
    """The run's options as simulated: no compile (nothing runs a kernel), no values drawn (`init_from`
    set: `parallelize` only allocates), the precision the GPU run would use kept as it is."""
    return replace(options, compile=False, init_from="(simulated: no values)")


def fake_allocate(mode: Any) -> Any:
    """`parallelize`'s allocation step under fake `mode`: the rank's shards as fake tensors, no values drawn.
    Only the allocation: the cut runs outside fake mode, as FSDP2 over a TP mesh concatenates real mesh tensors
    (a fake mode refuses them)."""

    def allocate(parts: list, seed: int, device: torch.device, draw: bool = True) -> None:
        with mode:
            materialize(parts, seed, device, draw=False)

    return allocate


def rank_peak(run: Run, pp_rank: int) -> dict[str, int]:
    """Bytes per category at the peak of a training step of the dp 0 / tp 0 rank of pipeline rank `pp_rank`,
    its optimizer state allocated."""
    layout = run.layout
    rank = rank_of(layout, pp=pp_rank)
    actions = rank_actions(layout, pp_rank) if layout.pp > 1 else []  # on a fake group of its own: first
    hook = sys.excepthook  # each process group wraps it in a "[rankN]:" prefix: one position's, not a stack
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=layout.world_size)
    try:
        with cuda_kernels(run.record.get("hardware", {}).get("kind", "cpu")):
            return _step_peak(run, pp_rank, actions)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        forget_meshes()


def _step_peak(run: Run, pp_rank: int, actions: list) -> dict[str, int]:
    """`rank_peak` inside the position's process group."""
    layout, options = run.layout, run.options
    device, mode = torch.device(DEVICE), fake_mode()
    mesh = build_mesh(layout, DEVICE)
    runner = build_runner(run.model, layout, mesh, sim_options(options), device, fake_allocate(mode))
    stages = rank_stages(layout, pp_rank, actions, mesh, options.precision) if layout.pp > 1 else None
    strict(mode)
    with mode:
        optimizer, schedule = build_optimizer(runner.parts, run.optim, max(run.steps, 2))
        rows = layout.micro * layout.microbatches  # the rank's batch, as its loader hands it
        shape = (rows, options.seq_len // layout.cp)  # a cp rank's two chunks of each sequence (data/context_split.py)
        batch = tuple(torch.randint(0, run.model.vocab_size, shape, device=device) for _ in range(2))
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            p.grad = torch.zeros_like(p)  # before the tracker: it counts them as gradients
        tracker = StepTracker()
        tracker.track_external(*runner.parts, optimizer)
        with tracker, propagation_unseen(tracker):
            optimizer.step()  # the first update: AdamW's moments allocated
            precompute_scales(runner.parts, options.fp8)  # as the loop does after each update (float8 all-gather)
            optimizer.zero_grad(set_to_none=True)
            forward_backward(runner, layout, stages, batch)
            runner.clip_grad_norm(run.optim.grad_clip)
            optimizer.step()
            precompute_scales(runner.parts, options.fp8)
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
        return tracker.peak()


def forward_backward(
    runner: Runner, layout: Layout, stages: RankStages | None, batch: tuple[torch.Tensor, ...]
) -> None:
    """The runner's own forward/backward; a pipeline rank's stages in its schedule's order (pipeline.py)."""
    if isinstance(runner, PipelineRunner) and stages is not None:
        step_stages(runner, layout, stages, batch)
    else:
        runner.forward_backward(*batch)
