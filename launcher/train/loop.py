"""The worker: everything one rank does, from its device to the summary. The loop fits one screen."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from launcher import flops
from launcher.config import TrainConfig, compile_enabled
from launcher.data import BatchLoader, Splits, load_splits
from launcher.files import write_json
from launcher.hardware import peak_flops
from launcher.layout import Layout, from_config, owner_rank, worker_threads, workers_per_node
from launcher.metrics.console import ConsoleView
from launcher.metrics.meter import Meter, memory_gib, memory_measure
from launcher.metrics.profile import StepProfiler
from launcher.metrics.sinks import JsonlSink, WandbSink
from launcher.model.init import AllocationFailed, meta_model
from launcher.parallel import Runner, parallelize
from launcher.precision import autocast_for, precision_mode
from launcher.train.checkpoint import Checkpointer, Stateful, resolve_resume
from launcher.train.fit import (
    allocator_mode,
    gather_ranks,
    gather_rows,
    memory_lines,
    memory_summary,
    out_of_memory,
    set_cpu_allocator,
    smoke_step,
)
from launcher.train.guard import Guard, injected_nan, injected_nan_step
from launcher.train.optim import build_optimizer, optimizer_impl
from launcher.train.preemption import PreemptionFlag
from launcher.train.spike import SpikeGuard, Trainee
from launcher.train.watchdog import Off, Watchdog

log = logging.getLogger("launcher")


def pick_device(cfg: TrainConfig) -> torch.device:
    """cuda: the GPU `spawn.run_rank` set from the local rank (torchrun's LOCAL_RANK or SLURM_LOCALID;
    SLURM sets no LOCAL_RANK), cuda:0 for a world of one."""
    if cfg.hardware.kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_logger(run_dir: Path, rank: int) -> None:
    handler = logging.FileHandler(run_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def run_eval(runner: Runner, loader: BatchLoader, batches: int) -> float:
    loader.position = 0  # the same validation samples every time
    losses = [runner.evaluate(*loader.next_batch()) for _ in range(batches)]
    return sum(losses) / len(losses)


def loaders(
    cfg: TrainConfig, layout: Layout, splits: Splits, dp_rank: int, cp_rank: int = 0
) -> tuple[BatchLoader, BatchLoader]:
    """Training and validation batches: each step, `layout.local_batch` sequences per data-parallel
    rank (its microbatches, which the runner splits; a cp rank's chunks of them), `layout.global_batch`
    over all."""
    batch, cp = layout.global_batch, (cp_rank, layout.cp)
    return (
        BatchLoader(splits.train, cfg.seq_len, batch, dp_rank, layout.dp, cfg.seed, *cp),
        BatchLoader(splits.val, cfg.seq_len, batch, dp_rank, layout.dp, cfg.seed + 1, *cp),
    )


def train(
    cfg: TrainConfig,
    run_dir: Path,
    rank: int = 0,
    layout: Layout | None = None,
    prediction: dict[str, Any] | None = None,
    watchdog: Watchdog | Off | None = None,
) -> dict[str, Any]:
    """Train one rank to the end; return the summary (the same on every rank). `layout`: the run's
    (None: the single-process layout `cfg` fixes, for direct calls); `prediction`: the planner's for
    it, put into summary.json beside what was measured; `watchdog`: where this rank reports its phases."""
    t_start = time.perf_counter()
    watchdog = watchdog or Off()
    layout = layout or from_config(cfg, 1)
    run_dir.mkdir(parents=True, exist_ok=True)
    rank_logger(run_dir, rank)
    device = pick_device(cfg)
    allocator = allocator_mode(cfg.cpu_allocator, cfg.steps)
    if device.type == "cpu" and not set_cpu_allocator(allocator):
        allocator = "glibc default"  # not glibc: no mallopt
    coords = layout.coordinates(rank)
    owner = rank == owner_rank(layout)
    threads = worker_threads(cfg.threads, workers_per_node(layout.world_size, cfg.nodes))
    torch.set_num_threads(threads)

    train_loader, val_loader = loaders(cfg, layout, load_splits(cfg.data), coords["dp"], coords["cp"])
    global_batch = layout.global_batch

    torch.manual_seed(cfg.seed)  # dropout
    try:
        runner = parallelize(meta_model(cfg.model), layout, cfg, autocast_for(cfg, layout, device), device)
    except AllocationFailed as err:
        raise out_of_memory(rank, err, prediction) from None
    build_s = time.perf_counter() - t_start
    optimizer, schedule = build_optimizer(runner.parts, cfg.optim, cfg.steps)

    flops_per_token = flops.flops_per_token(cfg.model, cfg.seq_len)
    peak = peak_flops(cfg.hardware, threads, cfg.cache_dir)
    meter = Meter(global_batch * cfg.seq_len, flops_per_token, peak, layout.world_size, device)
    n_params = flops.num_params(cfg.model)
    header = (
        f"[bold]{cfg.model.name}[/] {n_params / 1e6:.1f}M params · layout {asdict(layout)} · "
        f"batch {global_batch}x{cfg.seq_len} · {threads} threads/worker · peak {peak / 1e12:.3f} TFLOP/s/device"
    )
    view = ConsoleView(cfg.metrics.console if owner else "none", cfg.steps, header, cfg.metrics.moe_table)
    sinks: list[Any] = []
    if owner:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if cfg.metrics.wandb.mode != "disabled":
            sinks.append(WandbSink(cfg.metrics.wandb, run_dir, {"layout": asdict(layout), **asdict(cfg)}))
    log.info("rank %d coords %s threads %d device %s", rank, coords, threads, device)

    def finish(summary: dict[str, Any]) -> dict[str, Any]:
        """The run's summary (the same on every rank), written by the owner; the sinks closed."""
        summary |= {"world_size": layout.world_size, "layout": asdict(layout), "model": cfg.model.name}
        summary |= {"params": n_params, "precision": precision_mode(cfg, layout), "compile": compile_enabled(cfg)}
        summary |= {"optimizer_impl": optimizer_impl(optimizer), "wall_time_s": time.perf_counter() - t_start}
        summary["peak_mem_measure"] = memory_measure(device)
        if device.type == "cpu":  # how glibc's malloc was tuned (launcher/train/fit.py)
            summary["cpu_allocator"] = allocator
        if runner.moe:  # the MoE experts' matmuls: loop, or grouped_mm (launcher/model/experts.py)
            summary["expert_impl"] = runner.moe[0].experts.impl
        if prediction is not None:
            summary["prediction"] = prediction
        if owner:
            write_json(run_dir / "summary.json", summary)
            for sink in sinks:
                sink.close()
        view.close(summary)
        return summary

    ckpt_root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    checkpointer = Checkpointer(cfg.checkpoint, ckpt_root, rank, device)
    start = 0
    guard = Guard(cfg.optim.skip_nonfinite, rank, checkpointer)
    resumed = checkpointer.load(resolve_resume(cfg.resume, ckpt_root), runner.parts, optimizer)
    if resumed is not None:
        start = resumed.step
        guard.skipped = resumed.extras.get("skipped_steps", 0)
        schedule.load_state_dict(resumed.extras["schedule"])
        train_loader.load_state_dict(resumed.extras["loader"])
        view.note(f"resumed from step {start} ({ckpt_root})")
    if cfg.steps == 0:  # built for real: measure, and stop
        smoke_loss = smoke_step(runner, layout, train_loader.next_batch(), device) if cfg.smoke else None
        per_rank = gather_ranks(memory_gib(device))
        for line in memory_lines(per_rank, prediction):
            view.note(line)
        summary = {"steps": 0, "smoke_loss": smoke_loss, "build_time_s": build_s, **memory_summary(per_rank)}
        return finish(summary)
    trainee = Trainee(runner.parts, optimizer, schedule, train_loader, device)
    spikes = SpikeGuard(cfg.guard, trainee, checkpointer, sinks, view, resumed)  # guard.spike: skip or roll back

    def save(step: int, final: bool) -> dict[str, float]:
        watchdog.phase("checkpoint", step)
        extras = {"loader": train_loader.state_dict(), "schedule": schedule.state_dict(), "spike": spikes.state_dict()}
        extras |= {"model": asdict(cfg.model), "skipped_steps": guard.skipped}  # export reads the model
        return checkpointer.save(runner.parts, optimizer, Stateful(step, extras), final)

    preemption = PreemptionFlag()
    profiler = StepProfiler(cfg.profile, run_dir, rank, device)
    nan_step = injected_nan_step(rank)
    rows: list[dict[str, Any]] = []
    val_loss = None
    per_layer = cfg.metrics.moe_table or cfg.metrics.wandb.mode != "disabled"  # MoE: each layer's load, logged
    step = start
    while step < cfg.steps:
        spikes.keep(step, cfg.steps)  # rollback: the in-memory snapshot, every guard.snapshot_every steps
        step += 1
        watchdog.phase("data", step)
        meter.start()
        profiler.begin(step)
        inputs, targets = train_loader.next_batch()
        watchdog.phase("forward_backward", step)
        with injected_nan(runner.parts, step == nan_step), spikes.poisoned(runner.parts):
            loss = runner.forward_backward(inputs.to(device), targets.to(device))
        watchdog.phase("optimizer", step)
        grad_norm = runner.clip_grad_norm(cfg.optim.grad_clip)
        lr = schedule.get_last_lr()[0]
        # NaN/inf: stop (exit 3), or skip the update; a spike: skip it, or roll back (launcher/train/spike.py)
        if guard.update(step, loss, grad_norm, runner) and spikes.update(step, loss, grad_norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if spikes.rolled_back_to is not None:  # on from the snapshot's step, those batches never served again
            profiler.end(step)
            step = spikes.rolled_back_to
            continue
        schedule.step()
        balance = runner.update_balance(per_layer)  # MoE: routing biases after the step, and their metrics
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profiler.end(step)
        row = meter.stop(step, loss, lr, grad_norm) | balance
        loads = row.pop("moe_layers", [])  # per MoE layer: to the panel and wandb, not kept in `rows`
        if cfg.optim.skip_nonfinite:
            row["skipped_steps"] = guard.skipped
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.steps):
            watchdog.phase("eval", step)
            val_loss = row["val_loss"] = run_eval(runner, val_loader, cfg.eval.batches)
        rows.append(row)
        # one collective a step: every rank's memory (shown on logged steps) and stop request together
        per_rank = gather_rows([row["mem_gib"], float(preemption.raised)])
        stop = any(stop for _, stop in per_rank)  # a stop signal on any rank: every rank saves this step, then stops
        if stop or checkpointer.due(step, cfg.steps):  # before the row is logged: it gets the save's time and bytes
            row |= save(step, final=stop or step == cfg.steps)  # a final save that fails ends the run
        if step % cfg.metrics.log_every == 0 or step == cfg.steps or "val_loss" in row or "ckpt_bytes" in row:
            row.update(memory_summary([mem for mem, _ in per_rank], "mem_gib"))
            for sink in sinks:
                sink.log(row, loads)
            view.update(row, loads)
            log.info("%s", row)
        if stop:
            checkpointer.wait()
            preemption.restore()
            view.close({"preempted_at_step": step, "checkpoint": str(ckpt_root)})
            return {"preempted_at_step": step, "checkpoint": str(ckpt_root)}
    watchdog.phase("checkpoint", cfg.steps)  # an async save in flight completes
    checkpointer.wait()
    preemption.restore()
    profiled = profiler.finish()  # every rank's top ops, one line each
    for line in profiled:
        view.note(line)
        log.info("profile %s", line)

    if not rows:  # resumed at the end: nothing left to train
        view.close({"resumed_at_step": start})
        return {"final_loss": None, "steps": cfg.steps, "resumed_from": start}
    timed = rows[1:] or rows  # the first step pays one-time costs (allocations, caches)
    summary = {
        "final_loss": rows[-1]["loss"],
        **{k: v for k, v in rows[-1].items() if k.startswith("moe_")},  # MoE balance at the last step
        "val_loss": val_loss,
        "steps": cfg.steps,
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "median_tflops_per_device": statistics.median(r["tflops_per_device"] for r in timed),
        "median_mfu": statistics.median(r["mfu"] for r in timed),
        **memory_summary(gather_ranks(memory_gib(device))),  # a high-water mark: the run's peak
        "flops_per_token": flops_per_token,
        "peak_flops_per_device": peak,
        "threads_per_worker": threads,
        "skipped_steps": guard.skipped,
        **checkpointer.summary(),  # save time and bytes per rank (the planner's bytes: prediction)
        **({"profile": profiled} if profiled else {}),
    }
    return finish(summary)
