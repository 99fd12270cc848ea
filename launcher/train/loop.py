"""The worker: everything one rank does, from its device to the summary. `setup` builds the rank and the
step's hooks (launcher/train/setup.py); then the loop, one `train_step` at a time (data -> forward/backward
-> update -> metrics; resilience and observers join at the hooks' moments, launcher/train/hooks.py); then
`summarize`. The loop fits one screen."""

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
from launcher.parallel.compiled import CompileReport
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
from launcher.train.hooks import Step
from launcher.train.optim import optimizer_impl
from launcher.train.setup import Worker, setup
from launcher.train.watchdog import Off, Watchdog

log = logging.getLogger("launcher")


def train(run: Run, run_dir: Path, rank: int = 0, watchdog: Watchdog | Off | None = None) -> dict[str, Any]:
    """Train one rank to the end; return the summary (the same on every rank). `watchdog`: where this
    rank reports its phases."""
    w = setup(run, run_dir, rank, watchdog or Off())
    if run.steps == 0:  # built for real: measure, and stop
        return finish(w, measure(w))
    rows: list[dict[str, Any]] = []
    step = run.steps if w.hooks.ended else w.start  # ft: restarted after the others finished the run
    while step < run.steps:
        s = train_step(w, Step(step + 1, run.steps))
        if not s.counted:  # rolled back, or an ft step to redo: on from that step
            step = s.redo
            continue
        step = s.number  # ft: a group that healed from a peer is on the peer's step
        if not rows and w.runner.compiled_units:  # the first step compiled the blocks: say what it did
            line = CompileReport.now(w.runner.compiled_units).line()
            w.view.note(line)
            log.info("%s", line)
        rows.append(s.row)
        if report(w, s):  # a stop signal: every rank saved this step
            w.checkpointer.wait()
            w.hooks.at_end(stopped=True)
            stopped = {"preempted_at_step": step, "checkpoint": str(w.checkpointer.root)}
            w.view.close(stopped)
            return stopped
    w.hooks.before_save(run.steps)  # an async save in flight completes
    w.checkpointer.wait()
    w.hooks.at_end(stopped=False)
    if not rows:  # resumed at the end (ft: or the run ended without this group): nothing left to train
        w.view.close({"resumed_at_step": w.start})
        return {"final_loss": None, "steps": run.steps, "resumed_from": w.start}
    return finish(w, summarize(w, rows))


def train_step(w: Worker, s: Step) -> Step:
    """One step: data -> forward/backward -> update -> metrics, the hooks at their moments (hooks.py). A step
    that counts ends with its metrics row in `s.row`; one that does not, with `s.redo`."""
    run, runner, hooks = w.run, w.runner, w.hooks
    hooks.before_step(s)
    w.meter.start()
    inputs, targets = w.train_loader.next_batch()
    with hooks.during_forward(s):
        s.loss = runner.forward_backward(inputs.to(w.device), targets.to(w.device))
    hooks.after_backward(s)
    s.grad_norm = runner.clip_grad_norm(run.optim.grad_clip)
    lr = w.schedule.get_last_lr()[0]
    s.updated = hooks.allow_update(s)  # ft: committed; finite (launcher/train/guard.py); no spike (spike.py)
    if s.updated:
        w.optimizer.step()
    w.optimizer.zero_grad(set_to_none=True)
    if s.counted:
        w.schedule.step()
    hooks.after_update(s)
    if s.counted and w.device.type == "cuda":
        torch.cuda.synchronize(w.device)
    hooks.after_step(s)
    if not s.counted:
        return s
    s.row = w.meter.stop(s.number, s.loss, lr, s.grad_norm) | s.row
    if run.eval.every and (s.number % run.eval.every == 0 or s.number == run.steps):
        hooks.before_eval(s)
        s.row |= run_eval(runner, w.val_loader, run.eval.batches)
    return s


def report(w: Worker, s: Step) -> bool:
    """After a step: save when due or asked to stop, log the row when due; whether to stop now."""
    run, step, row = w.run, s.number, s.row
    # one collective a step: every rank's memory (shown on logged steps) and stop request together
    per_rank = gather_rows([row["mem_gib"], float(w.hooks.stop_requested)])
    stop = any(stop for _, stop in per_rank)  # a stop signal on any rank: every rank saves this step, then stops
    if stop or w.checkpointer.due(step, run.steps):  # before the row is logged: it gets the save's time and bytes
        row |= save(w, step, final=stop or step == run.steps)  # a final save that fails ends the run
    if step % run.metrics.log_every == 0 or step == run.steps or "val_loss" in row or "ckpt_bytes" in row:
        row.update(memory_summary([mem for mem, _ in per_rank], "mem_gib"))
        for sink in w.sinks:
            sink.log(row, s.loads)
        w.view.update(row, s.loads)
        log.info("%s", row)
    return stop


def save(w: Worker, step: int, final: bool) -> dict[str, float]:
    """A checkpoint of this step: the shards, the optimizer, what the loop resumes from, and the hooks' state."""
    w.hooks.before_save(step)
    extras = {"loader": w.train_loader.state_dict(), "schedule": w.schedule.state_dict()} | w.hooks.extras()
    extras["model"] = asdict(w.run.model)  # export reads the model
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


def summarize(w: Worker, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run measured: the last step's loss, median throughput and MFU, memory, checkpoint saves;
    and each hook's own (skipped steps, MoE balance, sources, profile, ft)."""
    timed = rows[1:] or rows  # the first step pays one-time costs (allocations, caches)
    val_losses = [row["val_loss"] for row in rows if "val_loss" in row]
    return {
        "final_loss": rows[-1]["loss"],
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
        **w.checkpointer.summary(),  # save time and bytes per rank (the planner's bytes: prediction)
        **w.hooks.summary(rows),
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
    if w.device.type == "cpu":  # how glibc's malloc was tuned (launcher/train/allocator.py)
        summary["cpu_allocator"] = w.allocator
    if w.runner.fp8 is not None:  # dtype=fp8: which layers compute in float8, which stay high precision and why
        summary["fp8"] = w.runner.fp8
    if w.runner.moe:  # the MoE experts' matmuls: loop, or grouped_mm (launcher/ops/experts.py)
        summary["expert_impl"] = w.runner.moe[0].experts.impl
    if run.prediction is not None:
        summary["prediction"] = run.prediction.as_dict()
    summary["config"] = run.record  # the whole composed config: `plan.calibrate` re-predicts the run from it
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
