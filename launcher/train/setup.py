"""A rank's setup for its run: its device, data, model shards, optimizer, metrics and checkpoints, the
state a resumed run continues from, and the step's hooks (`hooks_for`). Everything comes from the `Run`
(launcher/config/run.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from launcher import flops
from launcher.config.options import BuildOptions
from launcher.config.precision import precision_text
from launcher.config.run import Run
from launcher.data import BatchLoader, Splits, load_splits
from launcher.data.documents import data_span
from launcher.data.mix import MixLoader, Mixture, load_mixture, mix_loader
from launcher.layout import Layout, build_mesh, describe, owner_rank
from launcher.metrics.console import ConsoleView
from launcher.metrics.meter import Meter
from launcher.metrics.profile import StepProfiler
from launcher.metrics.sinks import JsonlSink, WandbSink
from launcher.model.hf import load_weights
from launcher.model.init import AllocationFailed
from launcher.parallel import build_runner
from launcher.parallel.runner import Runner
from launcher.train.allocator import allocator_mode, set_cpu_allocator
from launcher.train.checkpoint import Checkpointer, Stateful
from launcher.train.ckpt_pick import resolve_resume
from launcher.train.faults import fault_plan
from launcher.train.fit import out_of_memory
from launcher.train.guard import Guard, InjectedNan
from launcher.train.hooks import Hook, Hooks, Phases, Preemption
from launcher.train.observers import Fp8Scales, MoeBalance, Profiled, SourceLosses
from launcher.train.optim import build_optimizer
from launcher.train.preemption import PreemptionFlag
from launcher.train.replicas import replicas_of
from launcher.train.spike import SpikeGuard, Trainee
from launcher.train.watchdog import Off, Watchdog

log = logging.getLogger("launcher")


@dataclass
class Worker:
    """One rank as `setup` built it for its run."""

    run: Run
    run_dir: Path
    rank: int
    owner: bool  # rank 0 of the last pipeline stage: the user-facing output is its own
    device: torch.device
    allocator: str  # how glibc's malloc was tuned (launcher/train/allocator.py)
    t_start: float
    build_s: float  # from the start to the shards initialized
    runner: Runner
    optimizer: torch.optim.Optimizer
    schedule: Any  # the learning-rate schedule
    train_loader: BatchLoader
    val_loader: BatchLoader
    meter: Meter
    view: ConsoleView
    sinks: list[Any]
    checkpointer: Checkpointer
    resumed: Stateful | None = None
    hooks: Hooks = field(default_factory=Hooks)  # the step's (launcher/train/hooks.py); none with steps=0

    @property
    def start(self) -> int:
        """The step training continues after: a resumed checkpoint's, else 0."""
        return self.resumed.step if self.resumed is not None else 0

    @property
    def per_layer(self) -> bool:
        """MoE: each layer's load, shown (moe_table) or logged (wandb)."""
        return self.run.metrics.moe_table or self.run.metrics.wandb.mode != "disabled"


def pick_device(options: BuildOptions) -> torch.device:
    """cuda: the GPU `spawn.run_rank` set from the local rank (torchrun's LOCAL_RANK or SLURM_LOCALID;
    SLURM sets no LOCAL_RANK), cuda:0 for a world of one."""
    if options.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_logger(run_dir: Path, rank: int) -> None:
    handler = logging.FileHandler(run_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def loaders(
    layout: Layout,
    splits: Splits | Mixture,
    options: BuildOptions,
    dp_rank: int,
    cp: int = 0,
    groups: int = 1,
    group: int = 0,
) -> tuple[BatchLoader, BatchLoader]:
    """Training and validation batches: each step, `layout.local_batch` sequences per data-parallel
    rank (its microbatches, which the runner splits; a cp rank's chunks of them), `layout.global_batch`
    over all. A mixture's loaders follow its schedule (launcher/data/mix.py). `ft`: `groups` replica
    groups of this layout; group g's dp ranks come after those of groups 0 .. g-1, so that with every
    group alive the samples are those of one layout `groups` times as wide."""
    batch, cp_coords, seq, seed = layout.global_batch * groups, (cp, layout.cp), options.seq_len, options.seed
    dp_rank, dp_size = group * layout.dp + dp_rank, groups * layout.dp
    if isinstance(splits, Mixture):
        coords = {"dp_rank": dp_rank, "dp_size": dp_size, "cp_rank": cp, "cp_size": layout.cp}
        return mix_loader(splits, "train", seq, batch, seed, **coords), mix_loader(
            splits, "val", seq, batch, seed + 1, **coords
        )
    return (
        BatchLoader(splits.train, seq, batch, dp_rank, dp_size, seed, *cp_coords),
        BatchLoader(splits.val, seq, batch, dp_rank, dp_size, seed + 1, *cp_coords),
    )


def outputs(run: Run, run_dir: Path, owner: bool) -> tuple[ConsoleView, list[Any]]:
    """The console view (the owner's; silent elsewhere) and the metrics sinks (the owner's only)."""
    layout, options = run.layout, run.options
    header = (
        f"[bold]{run.model.name}[/] {flops.num_params(run.model) / 1e6:.1f}M params · {describe(layout)} · "
        f"batch {layout.global_batch}x{options.seq_len} · {precision_text(options.precision, options.fp8)} · "
        f"{options.threads} thread"
        f"{'s' * (options.threads != 1)}/worker · "
        f"peak {options.peak_flops / 1e12:.3f} TFLOP/s/device"
    )
    view = ConsoleView(run.metrics.console if owner else "none", run.steps, header, run.metrics.moe_table)
    sinks: list[Any] = []
    if owner:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if run.metrics.wandb.mode != "disabled":
            sinks.append(WandbSink(run.metrics.wandb, run_dir, {"layout": asdict(layout), **run.record}))
    return view, sinks


def build(run: Run, rank: int, device: torch.device) -> Runner:
    """This rank's shards of the model, allocated and initialized (seeded, or from init.from)."""
    layout = run.layout
    torch.manual_seed(run.options.seed)  # dropout
    try:
        mesh = build_mesh(layout, device.type) if layout.world_size > 1 else None
        runner = build_runner(run.model, layout, mesh, run.options, device)
        load_weights(runner.parts, run.options.init_from)  # init.from: the folder's weights, each rank its boxes
        return runner
    except AllocationFailed as err:
        raise out_of_memory(rank, err, run.prediction) from None


def setup(run: Run, run_dir: Path, rank: int, watchdog: Watchdog | Off) -> Worker:
    """Everything this rank needs before its first step, resumed from the newest checkpoint (resume)."""
    t_start = time.perf_counter()
    layout, options = run.layout, run.options
    run_dir.mkdir(parents=True, exist_ok=True)
    rank_logger(run_dir, rank)
    device = pick_device(options)
    allocator = allocator_mode(run.cpu_allocator, run.steps)
    if device.type == "cpu" and not set_cpu_allocator(allocator):
        allocator = "glibc default"  # not glibc: no mallopt
    coords = layout.coordinates(rank)
    owner = rank == owner_rank(layout)
    torch.set_num_threads(options.threads)
    data = load_mixture(run.data) if run.data.name == "mix" else load_splits(run.data)
    groups = (run.ft.replicas, run.replica) if run.replica is not None else (1, 0)  # ft: this replica group
    train_loader, val_loader = loaders(layout, data, options, coords["dp"], coords["cp"], *groups)
    runner = build(run, rank, device)
    build_s = time.perf_counter() - t_start
    optimizer, schedule = build_optimizer(runner.parts, run.optim, run.steps)
    eos, span = options.document_eos, float(options.seq_len)
    if eos is not None:  # attention within documents: the train split's documents set its work
        span = data_span(data, eos, options.seq_len)
    flops_per_token = flops.flops_per_token(run.model, span)
    tokens = layout.global_batch * options.seq_len
    fp8_peak = options.fp8.peak_flops if options.fp8 else 0.0  # mfu_fp8_peak beside the MFU (bf16 peak)
    meter = Meter(tokens, flops_per_token, options.peak_flops, layout.world_size, device, fp8_peak)
    view, sinks = outputs(run, run_dir, owner)
    log.info("rank %d coords %s threads %d device %s", rank, coords, options.threads, device)
    checkpointer = Checkpointer(run.checkpoint, Path(run.checkpoint.dir or run_dir / "checkpoints"), rank, device)
    worker = Worker(
        run, run_dir, rank, owner, device, allocator, t_start, build_s, runner, optimizer, schedule,
        train_loader, val_loader, meter, view, sinks, checkpointer,
    )  # fmt: skip
    worker.resumed = resume(worker)
    if run.steps:  # steps=0 measures the build and trains nothing
        worker.hooks = hooks_for(worker, watchdog)
    return worker


def hooks_for(w: Worker, watchdog: Watchdog | Off) -> Hooks:
    """The step's hooks, each concern's own, in the order the loop calls them at every moment: ft's commit
    before the non-finite guard before the spike guard (which sees finite steps only); the snapshot
    before the step's phase. An observer or a test fault only when it is on."""
    run, runner, resumed = w.run, w.runner, w.resumed
    replicas = replicas_of(run, w.rank, w)  # ft: the other replica groups; None with ft off
    guard = Guard(run.optim.skip_nonfinite, w.rank, w.checkpointer, runner, resumed)  # NaN/inf: stop or skip
    trainee = Trainee(runner.parts, w.optimizer, w.schedule, w.train_loader, w.device)
    spikes = SpikeGuard(run.guard, trainee, w.checkpointer, w.sinks, w.view, resumed)  # skip or roll back
    if replicas is not None:
        replicas.share(guard, spikes)  # a group healing from this one gets the guards' state too
    profiler = StepProfiler(run.profile, w.run_dir, w.rank, w.device) if run.profile.start is not None else None
    hooks: list[Hook | None] = [
        SourceLosses(runner, w.train_loader) if isinstance(w.train_loader, MixLoader) else None,
        replicas,
        guard,
        spikes,
        Phases(watchdog),
        Profiled(profiler, w.view) if profiler is not None else None,
        InjectedNan(runner.parts, w.rank) if fault_plan().nan_step(w.rank) is not None else None,  # tests only
        MoeBalance(runner, w.per_layer) if runner.moe_model else None,
        Fp8Scales(runner.parts, run.options.fp8) if run.options.fp8 is not None else None,
        Preemption(PreemptionFlag()),
    ]
    return Hooks([hook for hook in hooks if hook is not None])


def resume(w: Worker) -> Stateful | None:
    """Load the checkpoint `resume` names (auto: the newest complete one, if any) into the model,
    the optimizer, the schedule and the loader; None when training starts fresh."""
    root = w.checkpointer.root
    resumed = w.checkpointer.load(resolve_resume(w.run.resume, root), w.runner.parts, w.optimizer)
    if resumed is None and w.run.options.init_from:  # else silent: where the weights came from
        w.view.note(f"initial weights from {w.run.options.init_from} (init.from), not seeded random")
    if resumed is not None:
        w.schedule.load_state_dict(resumed.extras["schedule"])
        w.train_loader.load_state_dict(resumed.extras["loader"])
        w.view.note(f"resumed from step {resumed.step} ({root})")
        if isinstance(w.train_loader, MixLoader) and w.train_loader.note:  # new weights: a new phase
            w.view.note(w.train_loader.note)
            log.info("%s", w.train_loader.note)
    return resumed
