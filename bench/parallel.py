"""Parallel layouts side by side on this CPU: `python -m bench parallel [--quick] [--models small,d1024]`.

1. Throughput: for tp, dp, pp in {1, 2} (all 8 layouts, up to 8 gloo workers), on the `small`
   model and a dim-1024 model: tokens/s, MFU (model FLOPs from flops.py over the calibrated fp32
   GEMM peak of a worker's thread count) and the communication share of step time.
   Communication share: the share of one profiled step during which a gloo operation (collective or
   P2P send/recv, on any thread) is in flight, its intervals merged. It includes waiting for the
   slowest peer (for pipelines: the bubble, seen as waits in recv), and counts transfers that
   overlap compute. The workers share this machine's cores (threads per worker = cores // world,
   at least 1): with more workers than cores they time-slice, which the table shows as it is.
2. Activation memory per pipeline schedule (small model, pp=2, 8 micro-batches of one sequence):
   the peak bytes of tensors autograd saves for backward on each stage, counted with
   saved-tensor hooks (parameters excluded, a storage counted once while any of its saves is alive).
   GPipe holds every micro-batch's activations at its peak, 1F1B at most pp - stage of them.
   (Not shown for recompute: tensors kept by activation checkpointing - block inputs, the
   selective policy's cache - bypass saved-tensor hooks, so they cannot be counted this way.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from launcher import flops
from launcher.config.layout_keys import from_config
from launcher.config.model import ModelConfig
from launcher.config.schema import CONF_DIR, TrainConfig
from launcher.data.context_split import split_sequence
from launcher.hardware.probes import measure_gemm_flops
from launcher.layout import build_mesh, worker_threads
from launcher.model.init import initialized_model
from launcher.parallel import build_runner
from launcher.planner import build_options
from launcher.train.optim import build_optimizer

LAYOUTS = [dict(tp=tp, dp=dp, pp=pp) for pp in (1, 2) for dp in (1, 2) for tp in (1, 2)]


def model_config(name: str) -> ModelConfig:
    if name == "d1024":  # a CPU-sized model with the matmul shapes of a real one
        return ModelConfig(
            name="d1024", dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=2816, vocab_size=256, max_seq_len=1024
        )
    from omegaconf import OmegaConf

    base = OmegaConf.structured(ModelConfig)
    return OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.load(Path(CONF_DIR) / "model" / f"{name}.yaml")))


def bench_config(model: ModelConfig, layout: dict[str, int], seq_len: int, batch: int) -> TrainConfig:
    """`batch` sequences per step, in 2 pp microbatches per dp rank when pipelined (the default)."""
    microbatches = 2 * layout["pp"] if layout["pp"] > 1 else 1
    micro = batch // (layout["dp"] * microbatches)
    return TrainConfig(model=model, seq_len=seq_len, batch={"micro": micro, "global": batch}, **layout)


# ---------------------------------------------------------------------------------------------- throughput


def comm_seconds(prof: Any) -> float:
    """Length of the union of the intervals of every gloo/nccl operation in the profile."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.name.startswith(("gloo:", "nccl:"))
    )
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e6  # profiler times are in microseconds


def train_step(runner: Any, optimizer: Any, tokens: torch.Tensor, cp: int = 1, cp_rank: int = 0) -> None:
    """One step on (batch, seq + 1) token rows (a context-parallel rank trains on its chunks of them)."""
    runner.forward_backward(*(split_sequence(t, cp, cp_rank) for t in (tokens[:, :-1], tokens[:, 1:])))
    runner.clip_grad_norm(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def throughput_worker(rank: int, world: int, jobs: list[tuple[str, dict[str, int]]], opts: dict[str, Any]) -> Any:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(worker_threads(None, world))
    out = []
    for model_name, lay in jobs:
        cfg = bench_config(model_config(model_name), lay, opts["seq_len"], opts["batch"])
        layout = from_config(cfg, world)
        runner = build_runner(cfg.model, layout, build_mesh(layout), build_options(cfg, layout), torch.device("cpu"))
        optimizer, _ = build_optimizer(runner.parts, cfg.optim, 100)
        dp_rank, local = layout.coordinates(rank)["dp"], opts["batch"] // layout.dp
        gen = torch.Generator().manual_seed(0)
        batches = [
            torch.randint(0, cfg.model.vocab_size, (opts["batch"], cfg.seq_len + 1), generator=gen)[
                dp_rank * local : (dp_rank + 1) * local
            ]
            for _ in range(opts["steps"] + 2)
        ]
        train_step(runner, optimizer, batches[0])  # warm-up: allocations, pipeline shape inference
        times = []
        for tokens in batches[1:-1]:
            t0 = time.perf_counter()
            train_step(runner, optimizer, tokens)
            times.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            train_step(runner, optimizer, batches[-1])
            profiled = time.perf_counter() - t0
        out.append({"step_s": statistics.median(times), "comm_share": comm_seconds(prof) / profiled})
    return out


def run_throughput(models: list[str], opts: dict[str, Any], peaks: dict[int, float]) -> list[dict[str, Any]]:
    from tests.dist import run

    rows = []
    for world in (1, 2, 4, 8):
        jobs = [(m, lay) for m in models for lay in LAYOUTS if lay["tp"] * lay["dp"] * lay["pp"] == world]
        per_rank = run(throughput_worker, world, jobs, opts, timeout=3600)
        threads = worker_threads(None, world)
        peak = peaks[threads]
        for i, (model_name, lay) in enumerate(jobs):
            step_s = max(r[i]["step_s"] for r in per_rank)  # the step ends when the slowest rank ends
            tokens_per_s = opts["batch"] * opts["seq_len"] / step_s
            fpt = flops.flops_per_token(model_config(model_name), opts["seq_len"])
            rows.append(
                {
                    "model": model_name, **lay, "world": world, "threads": threads, "step_s": step_s,
                    "tokens_per_s": tokens_per_s, "mfu": flops.mfu(tokens_per_s / world, fpt, peak),
                    "comm_share": statistics.mean(r[i]["comm_share"] for r in per_rank),
                }
            )  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------- activation memory


class SavedTensorMeter:
    """Live and peak bytes of the tensors autograd saves for backward (inside `with meter:`)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.live, self.peak = exclude, 0, 0
        self.refs: dict[int, list[int]] = {}  # storage address → [saves alive, bytes]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        local = getattr(t, "_local_tensor", t)
        key = local.untyped_storage().data_ptr()
        if key in self.exclude or local.device.type == "meta":
            return t
        entry = self.refs.setdefault(key, [0, local.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        holder = _Saved(t.detach())  # not `t`: an output saved with its grad_fn would form a cycle
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __enter__(self) -> SavedTensorMeter:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


PIPELINES = {
    "gpipe": dict(pp_schedule="gpipe"),
    "1f1b": dict(pp_schedule="1f1b"),
    "interleaved_1f1b (v=2)": dict(pp_schedule="interleaved_1f1b", virtual_stages=2),
}


def activation_worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, int]:
    torch.set_num_threads(1)
    out = {}
    for name, keys in PIPELINES.items():
        cfg = replace(bench_config(model_config("small"), dict(tp=1, dp=1, pp=2), opts["seq_len"], 8), **keys)
        cfg = replace(cfg, batch={"micro": 1, "global": 8})  # 8 microbatches of 1
        layout = from_config(cfg, world)
        runner = build_runner(cfg.model, layout, build_mesh(layout), build_options(cfg, layout), torch.device("cpu"))
        tokens = torch.randint(0, 256, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
        runner.forward_backward(tokens[:, :-1], tokens[:, 1:])  # shape inference happens on the first step
        params = {p.untyped_storage().data_ptr() for part in runner.parts for p in part.parameters()}
        with SavedTensorMeter(params) as meter:
            runner.forward_backward(tokens[:, :-1], tokens[:, 1:])
        out[name] = meter.peak
    return out


def single_microbatch_bytes(seq_len: int) -> int:
    """Saved bytes of one sequence through the whole model in one process: the unit of the table."""
    cfg = bench_config(model_config("small"), dict(tp=1, dp=1, pp=1), seq_len, 1)
    model = initialized_model(cfg.model, cfg.seed, torch.device("cpu"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(params) as meter:
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return meter.peak


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, small model only")
    parser.add_argument("--models", default="small,d1024")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (median)")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    models = ["small"] if args.quick else args.models.split(",")
    opts = {"seq_len": args.seq_len, "batch": args.batch, "steps": 2 if args.quick else args.steps}
    cores = os.cpu_count() or 1
    if not args.skip_throughput:
        # measured now, on an idle machine (a calibration cached while other work ran would be low)
        peaks = {t: measure_gemm_flops(t, seconds=1.0) for t in sorted({worker_threads(None, w) for w in (1, 2, 4, 8)})}
        t0 = time.perf_counter()
        rows = run_throughput(models, opts, peaks)
        print(f"\nthroughput: global batch {args.batch} x {args.seq_len} tokens, fp32, gloo, {cores} cores here")
        print(
            "peak fp32 GEMM per worker: " + ", ".join(f"{t} thread(s) {p / 1e9:.0f} GFLOP/s" for t, p in peaks.items())
        )
        print(f"{'model':<7} {'tp':>2} {'dp':>2} {'pp':>2} {'ranks':>5} {'thr':>3} {'step s':>7} "
              f"{'tokens/s':>9} {'vs 1':>5} {'MFU':>6} {'comm':>5}")  # fmt: skip
        base = {r["model"]: r["tokens_per_s"] for r in rows if r["world"] == 1}
        for r in sorted(rows, key=lambda r: (r["model"], r["pp"], r["dp"], r["tp"])):
            print(
                f"{r['model']:<7} {r['tp']:>2} {r['dp']:>2} {r['pp']:>2} {r['world']:>5} {r['threads']:>3} "
                f"{r['step_s']:>7.3f} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base[r['model']]:>5.2f} "
                f"{r['mfu']:>6.1%} {r['comm_share']:>5.0%}"
            )
        print(f"({time.perf_counter() - t0:.0f} s; comm = share of step time with a gloo operation in flight)")
    from tests.dist import run

    per_stage = run(activation_worker, 2, {"seq_len": args.seq_len}, timeout=1800)
    unit = single_microbatch_bytes(args.seq_len)
    print(f"\npeak saved-activation bytes per stage: small model, pp=2, 8 micro-batches of 1 x {args.seq_len}")
    print(f"(unit: one micro-batch through the whole model in one process = {unit / 2**20:.1f} MiB)")
    print(f"{'schedule':<28} {'stage/rank 0':>16} {'stage/rank 1':>16}")
    for name in PIPELINES:
        cells = [f"{r[name] / 2**20:7.1f} MiB {r[name] / unit:4.1f}x" for r in per_stage]
        print(f"{name:<28} {cells[0]:>16} {cells[1]:>16}")
