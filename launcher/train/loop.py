"""The worker: everything one rank does, from its device to the summary. `setup` builds the rank
(launcher/train/setup.py); then the loop, one `step` at a time; then `summarize`. The loop fits one screen."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from launcher import flops
from launcher.config.precision import precision_text
from launcher.config.run import Run
from launcher.data import BatchLoader
from launcher.files import write_json
from launcher.layout.text import degrees_text
from launcher.metrics import sources
from launcher.metrics.charts import run_loss_curve
from launcher.metrics.meter import memory_gib, memory_measure
from launcher.metrics.profile import StepProfiler
from launcher.parallel.compiled import CompileReport
from launcher.parallel.float8 import precompute_scales
from launcher.parallel.runner import Runner
from launcher.train.checkpoint import Stateful
from launcher.train.fit import (
    gather_ranks,
    gather_rows,
    memory_lines,
    memory_summary,
    predicted_build_gib,
    smoke_step,
)
from launcher.train.guard import injected_nan, injected_nan_step
from launcher.train.optim import optimizer_impl
from launcher.train.preemption import PreemptionFlag
from launcher.train.setup import Worker, setup
from launcher.train.spike import SpikeGuard, Trainee
from launcher.train.watchdog import Off, Watchdog

log = logging.getLogger("launcher")


def train(run: Run, run_dir: Path, rank: int = 0, watchdog: Watchdog | Off | None = None) -> dict[str, Any]:
    """Train one rank to the end; return the summary (the same on every rank). `watchdog`: where this
    rank reports its phases."""
    w = setup(run, run_dir, rank, watchdog or Off())
    if run.steps == 0:  # built for real: measure, and stop
        return finish(w, measure(w))
    trainee = Trainee(w.runner.parts, w.optimizer, w.schedule, w.train_loader, w.device)
    spikes = SpikeGuard(
        run.guard, trainee, w.checkpointer, w.sinks, w.view, w.resumed
    )  # guard.spike: skip or roll back
    w.replicas.share(spikes)  # ft: a group healing from this one gets the guard's state too
    preemption, profiler = PreemptionFlag(), StepProfiler(run.profile, run_dir, rank, w.device)
    nan_step = injected_nan_step(rank)
    rows: list[dict[str, Any]] = []
    step = run.steps if w.replicas.ended else w.start  # ft: restarted after the others finished the run
    while step < run.steps:
        spikes.keep(step, run.steps)  # rollback: the in-memory snapshot, every guard.snapshot_every steps
        step += 1
        stepped = train_step(w, spikes, profiler, step, step == nan_step)
        if isinstance(stepped, int):  # rolled back, or an ft step to redo: on from that step
            step = stepped
            continue
        row, loads = stepped
        step = row["step"]  # ft: a group that healed from a peer is on the peer's step
        if not rows and w.runner.compiled_units:  # the first step compiled the blocks: say what it did
            line = CompileReport.now(w.runner.compiled_units).line()
            w.view.note(line)
            log.info("%s", line)
        rows.append(row)
        if report(w, spikes, preemption, step, row, loads):  # a stop signal: every rank saved this step
            w.checkpointer.wait()
            preemption.restore()
            stopped = {"preempted_at_step": step, "checkpoint": str(w.ckpt_root)}
            w.view.close(stopped)
            return stopped
    w.watchdog.phase("checkpoint", run.steps)  # an async save in flight completes
    w.checkpointer.wait()
    preemption.restore()
    profiled = profiler.finish()  # every rank's top ops, one line each
    for line in profiled:
        w.view.note(line)
        log.info("profile %s", line)
    if not rows:  # resumed at the end (ft: or the run ended without this group): nothing left to train
        w.replicas.close()
        w.view.close({"resumed_at_step": w.start})
        return {"final_loss": None, "steps": run.steps, "resumed_from": w.start}
    return finish(w, summarize(w, rows, profiled))


def train_step(
    w: Worker, spikes: SpikeGuard, profiler: StepProfiler, step: int, nan: bool
) -> tuple[dict[str, Any], list[Any]] | int:
    """One step: its metrics row and each MoE layer's load; or the step to go on from when this one does
    not count (the spike guard rolled back; ft: this group could not commit, and redoes it)."""
    run, runner, device = w.run, w.runner, w.device
    w.watchdog.phase("data", step)
    w.meter.start()
    profiler.begin(step)
    w.replicas.begin(step)  # ft: this step's quorum of replica groups, formed during forward and backward
    inputs, targets = w.train_loader.next_batch()
    w.watchdog.phase("forward_backward", step)
    with injected_nan(runner.parts, nan), spikes.poisoned(runner.parts), sources.recording(w.train_loader) as per_token:
        loss = runner.forward_backward(inputs.to(device), targets.to(device))
    by_source = sources.sums(runner, w.train_loader, per_token)  # a mixture's: loss and tokens per source
    loss = w.replicas.sync(runner.parts, loss)  # ft: gradients and loss averaged over the replica groups
    w.watchdog.phase("optimizer", step)
    grad_norm = runner.clip_grad_norm(run.optim.grad_clip)
    lr = w.schedule.get_last_lr()[0]
    # NaN/inf: stop (exit 3), or skip the update; a spike: skip it, or roll back (launcher/train/spike.py)
    # ft: not committed when this group failed a collective (the step is redone, same batch); a group that
    # healed from a peer just now is on the peer's step
    committed, step = w.replicas.commit(step)
    if committed and w.guard.update(step, loss, grad_norm, runner) and spikes.update(step, loss, grad_norm):
        w.optimizer.step()
        precompute_scales(runner.parts, run.options.fp8)  # FSDP2's float8 weight scales for the next step
    w.optimizer.zero_grad(set_to_none=True)
    if not committed or spikes.rolled_back_to is not None:
        precompute_scales(runner.parts, run.options.fp8)  # the restored weights'
        profiler.end(step)
        return spikes.rolled_back_to if spikes.rolled_back_to is not None else step - 1
    w.schedule.step()
    balance = runner.update_balance(w.per_layer)  # MoE: routing biases after the step, and their metrics
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.end(step)
    row = w.meter.stop(step, loss, lr, grad_norm) | sources.figures(w.train_loader, by_source) | balance
    row |= w.replicas.columns()  # ft: how many replica groups took part in this step
    loads = row.pop("moe_layers", [])  # per MoE layer: to the panel and wandb, not kept in the rows
    if run.optim.skip_nonfinite:
        row["skipped_steps"] = w.guard.skipped
    if run.eval.every and (step % run.eval.every == 0 or step == run.steps):
        w.watchdog.phase("eval", step)
        row |= run_eval(runner, w.val_loader, run.eval.batches)
    return row, loads


def report(
    w: Worker, spikes: SpikeGuard, preemption: PreemptionFlag, step: int, row: dict[str, Any], loads: list[Any]
) -> bool:
    """After a step: save when due or asked to stop, log the row when due; whether to stop now."""
    run = w.run
    # one collective a step: every rank's memory (shown on logged steps) and stop request together
    per_rank = gather_rows([row["mem_gib"], float(preemption.raised)])
    stop = any(stop for _, stop in per_rank)  # a stop signal on any rank: every rank saves this step, then stops
    if stop or w.checkpointer.due(step, run.steps):  # before the row is logged: it gets the save's time and bytes
        row |= save(w, spikes, step, final=stop or step == run.steps)  # a final save that fails ends the run
    if step % run.metrics.log_every == 0 or step == run.steps or "val_loss" in row or "ckpt_bytes" in row:
        row.update(memory_summary([mem for mem, _ in per_rank], "mem_gib"))
        for sink in w.sinks:
            sink.log(row, loads)
        w.view.update(row, loads)
        log.info("%s", row)
    return stop


def save(w: Worker, spikes: SpikeGuard, step: int, final: bool) -> dict[str, float]:
    """A checkpoint of this step: the shards, the optimizer, and what the loop resumes from."""
    w.watchdog.phase("checkpoint", step)
    extras = {"loader": w.train_loader.state_dict(), "schedule": w.schedule.state_dict(), "spike": spikes.state_dict()}
    extras |= {"model": asdict(w.run.model), "skipped_steps": w.guard.skipped}  # export reads the model
    return w.checkpointer.save(w.runner.parts, w.optimizer, Stateful(step, extras), final)


def run_eval(runner: Runner, loader: BatchLoader, batches: int) -> dict[str, float]:
    """`val_loss` over `batches` validation batches, and a mixture's `val_loss.LABEL` per source."""
    loader.position = 0  # the same validation samples every time
    losses, tables = [], []
    for _ in range(batches):
        batch = loader.next_batch()
        with sources.recording(loader) as per_token:
            losses.append(runner.evaluate(*batch))
        tables.append(sources.sums(runner, loader, per_token))
    summed = sum(tables[1:], tables[0]) if tables[0] is not None else None
    return {"val_loss": sum(losses) / len(losses)} | sources.figures(loader, summed, "val_", tokens=False)


def measure(w: Worker) -> dict[str, Any]:
    """`steps=0`: the shards built for real; measured memory per rank (optionally after one
    forward/backward, `smoke`) beside the planner's prediction."""
    run = w.run
    smoke_loss = smoke_step(w.runner, run.layout, w.train_loader.next_batch(), w.device) if run.smoke else None
    per_rank = gather_ranks(memory_gib(w.device))
    predicted = predicted_build_gib(run.prediction, run.smoke)
    what = " (weights and one step's activations)" if run.smoke else " (the built weights, before any step)"
    for line in memory_lines(per_rank, predicted, what):
        w.view.note(line)
    summary = {"steps": 0, "smoke_loss": smoke_loss, "build_time_s": w.build_s, **memory_summary(per_rank)}
    return summary | {"predicted_build_gib": predicted, "threads_per_worker": run.options.threads}


def summarize(w: Worker, rows: list[dict[str, Any]], profiled: list[str]) -> dict[str, Any]:
    """What the run measured: the last step's loss and MoE balance, median throughput and MFU, memory,
    checkpoint saves."""
    timed = rows[1:] or rows  # the first step pays one-time costs (allocations, caches)
    val_losses = [row["val_loss"] for row in rows if "val_loss" in row]
    return {
        "final_loss": rows[-1]["loss"],
        **{k: v for k, v in rows[-1].items() if k.startswith("moe_")},  # MoE balance at the last step
        "val_loss": val_losses[-1] if val_losses else None,
        "steps": w.run.steps,
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "median_tflops_per_device": statistics.median(r["tflops_per_device"] for r in timed),
        "median_mfu": statistics.median(r["mfu"] for r in timed),
        **{f"median_{k}": statistics.median(r[k] for r in timed) for k in ("mfu_fp8_peak",) if k in timed[0]},
        **memory_summary(gather_ranks(memory_gib(w.device))),  # a high-water mark: the run's peak
        "flops_per_token": w.meter.flops_per_token,
        "peak_flops_per_device": w.run.options.peak_flops,
        "threads_per_worker": w.run.options.threads,
        "skipped_steps": w.guard.skipped,
        **sources.realised_shares(rows),  # a mixture's tokens and share per source
        **w.checkpointer.summary(),  # save time and bytes per rank (the planner's bytes: prediction)
        **({"profile": profiled} if profiled else {}),
        **w.replicas.summary(rows),  # ft: the steps some replica group missed, and their tokens
    }


def finish(w: Worker, summary: dict[str, Any]) -> dict[str, Any]:
    """The run's summary (the same on every rank), written by the owner; the sinks closed."""
    run, layout, options = w.run, w.run.layout, w.run.options
    summary |= {"world_size": layout.world_size, "layout": asdict(layout), "model": run.model.name}
    summary |= {"params": flops.num_params(run.model), "compile": options.compile}
    summary["precision"] = precision_text(options.precision, options.fp8)  # as run: `fp8 (tensorwise) + bf16 autocast`
    if w.runner.compiled_units:  # graphs and graph breaks (launcher/parallel/compiled.py)
        summary["compiled"] = CompileReport.now(w.runner.compiled_units).summary()
    summary |= {"optimizer_impl": optimizer_impl(w.optimizer), "wall_time_s": time.perf_counter() - w.t_start}
    summary["peak_mem_measure"] = memory_measure(w.device)
    if w.device.type == "cpu":  # how glibc's malloc was tuned (launcher/train/fit.py)
        summary["cpu_allocator"] = w.allocator
    if w.runner.fp8 is not None:  # dtype=fp8: which layers compute in float8, which stay high precision and why
        summary["fp8"] = w.runner.fp8
    if w.runner.moe:  # the MoE experts' matmuls: loop, or grouped_mm (launcher/ops/experts.py)
        summary["expert_impl"] = w.runner.moe[0].experts.impl
    if run.prediction is not None:
        summary["prediction"] = run.prediction.as_dict()
    summary["config"] = run.record  # the whole composed config: `plan.calibrate` re-predicts the run from it
    w.replicas.close()
    if w.owner:
        write_json(w.run_dir / "summary.json", summary)
        for sink in w.sinks:
            sink.close()
    w.view.close(summary)
    if w.owner and summary["steps"]:  # after the table: the loss curve, drawn once training is over
        if line := run_loss_curve(w.run_dir, f"{run.model.name} · {degrees_text(layout)}"):
            w.view.note(line)
            log.info("%s", line)
    return summary
