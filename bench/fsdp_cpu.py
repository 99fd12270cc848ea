"""Issue 15: where FSDP dp_shard=2 loses time on CPU/gloo, at the peer shape (bench/peer_shape.py).

Three runs, one thread per process, the same local batch (8 x 2048) on every process:
- `1 process`: the reference step;
- `2 x 1 process`: two independent single-process runs at once (no communication): what sharing
  the machine's cores, caches and memory bandwidth alone costs, the floor for any 2-process layout;
- `fsdp dp_shard=2`: the launcher's FSDP2 over gloo.
Per run: median step ms, split into forward+backward, gradient clipping and optimizer step
(zero_grad included); then, from one profiled step of rank 0, the ms inside FSDP's own regions
(all-gather with its copy-in/out, reduce-scatter, ...) and in gloo operations. tokens/s per process
relative to `1 process` is the figure issue 15 tracks (FSDP=2 should sit near `2 x 1 process`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from omegaconf import OmegaConf

from bench.peer_shape import SHAPE
from launcher.config.layout_keys import from_config
from launcher.config.schema import TrainConfig
from launcher.layout import build_mesh
from launcher.parallel import build_runner
from launcher.planner import build_options
from launcher.train.optim import build_optimizer

BATCH = 8  # sequences per process per step


def peer_config(dp: int, extra: list[str]) -> TrainConfig:
    overrides = [*SHAPE, f"dp={dp}", f"batch.micro={BATCH}", f"batch.global={BATCH * dp}", *extra]
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_object(merged)


def regions(prof: Any) -> dict[str, float]:
    """ms per FSDP region (FSDP::...) and per gloo operation in the profile (nested regions counted
    in each: a region's time includes what runs inside it), summed over the FSDP units."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.name.startswith(("FSDP::", "gloo:")) or e.name in ("aten::_fused_adamw_", "aten::_foreach_norm"):
            name = re.sub(r" \(.*\)$| for .*$", "", e.name)  # summed over the blocks
            out[name] += (e.time_range.end - e.time_range.start) / 1e3
    return dict(out)


def worker(rank: int, world: int, dp: int, steps: int, extra: list[str]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    cfg = peer_config(dp, extra)
    layout = from_config(cfg, dp)
    mesh = build_mesh(layout) if layout.world_size > 1 else None
    runner = build_runner(cfg.model, layout, mesh, build_options(cfg, layout), torch.device("cpu"))
    optimizer, _ = build_optimizer(runner.parts, cfg.optim, 100)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
    phases: dict[str, list[float]] = defaultdict(list)

    def step() -> None:
        t0 = time.perf_counter()
        runner.forward_backward(tokens[:, :-1], tokens[:, 1:])
        t1 = time.perf_counter()
        runner.clip_grad_norm(1.0)
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        for name, value in (("fwd+bwd", t1 - t0), ("clip", t2 - t1), ("optim", t3 - t2), ("step", t3 - t0)):
            phases[name].append(value * 1e3)

    step()  # warm-up
    phases.clear()
    for _ in range(steps):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    medians = {name: statistics.median(values[:-1]) for name, values in phases.items()}
    return {"phases": medians, "profiled": {k: v[-1] for k, v in phases.items()}, "regions": regions(prof)}


def main(argv: list[str]) -> None:
    from tests.dist import run, run_many

    parser = argparse.ArgumentParser(prog="python -m bench fsdp_cpu")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (median), after one warm-up")
    parser.add_argument("--runs", default="1 process,2 x 1 process,fsdp dp_shard=2")
    parser.add_argument("--extra", default="", help="comma-separated config overrides for every run")
    opts = parser.parse_args(argv)
    extra = [x for x in opts.extra.split(",") if x]
    results: dict[str, list[dict[str, Any]]] = {}
    for name in opts.runs.split(","):
        args = (opts.steps, extra)
        if name == "1 process":
            results[name] = run(worker, 1, 1, *args, timeout=1800)
        elif name == "2 x 1 process":
            results[name] = [r[0] for r in run_many([(worker, 1, (1, *args))] * 2, timeout=1800)]
        else:
            results[name] = run(worker, 2, 2, *args, timeout=1800)
    ref = max(r["phases"]["step"] for r in results["1 process"]) if "1 process" in results else float("nan")
    print(f"peer shape, fp32, local batch {BATCH} x 2048, 1 thread per process; ms (median of {opts.steps} steps)")
    print(f"{'run':<18} {'step':>8} {'fwd+bwd':>8} {'clip':>6} {'optim':>6} {'tok/s/proc vs 1':>16}")
    for name, per_rank in results.items():
        ph = {k: max(r["phases"][k] for r in per_rank) for k in per_rank[0]["phases"]}
        print(
            f"{name:<18} {ph['step']:>8.0f} {ph['fwd+bwd']:>8.0f} {ph['clip']:>6.1f} {ph['optim']:>6.1f} "
            f"{ref / ph['step']:>16.3f}"
        )
    for name, per_rank in results.items():
        print(f"\n{name}, rank 0, profiled step ({per_rank[0]['profiled']['step']:.0f} ms): ms per region")
        for region, ms in sorted(per_rank[0]["regions"].items(), key=lambda kv: -kv[1]):
            print(f"  {region:<48} {ms:>8.1f}")
