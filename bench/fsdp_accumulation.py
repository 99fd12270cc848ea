"""Issue 23, finding 2: what FSDP holds between the micro-batches of one step, and what it costs.

`python -m bench fsdp_accumulation [--steps 3] [--model small] [--seq-len 256] [--microbatches 4]`:
dp_shard=2 on gloo, fp32, one thread per process, each accumulation option side by side:
- `reduce-scatter`: every micro-batch's gradients reduce-scattered into the sharded ones (the runtime
  since issue 23; HSDP skips only the all-reduce until the last micro-batch), as torchtitan does;
- `no_sync`: `set_requires_gradient_sync(False)` until the last micro-batch (the runtime before):
  FSDP keeps an unsharded gradient of every parameter until then.
Per option: the bytes held at the start of each micro-batch but the first, over those at the first
(ops' outputs still alive, `HeldBytes`), against the planner's gradients, and the median step time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import weakref
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import launcher.parallel.runner
from launcher.compat.torch_compat import inner_tensors
from launcher.config.layout_keys import from_config
from launcher.config.schema import TrainConfig, compose_config
from launcher.layout import Layout, build_mesh
from launcher.parallel import build_runner
from launcher.planner import build_options
from launcher.planner.memory import rank_memory
from launcher.train.optim import build_optimizer

RUNTIME = launcher.parallel.runner.set_gradient_sync


def no_sync(model: torch.nn.Module, layout: Layout, last: bool) -> None:
    """The accumulation before issue 23: no reduction at all until the last micro-batch."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)


OPTIONS = {"reduce-scatter": RUNTIME, "no_sync": no_sync}


class HeldBytes(TorchDispatchMode):
    """Every tensor an op makes inside it, by weak reference (a tensor that reached Python keeps its
    wrapper while it lives): `alive()` sums the storages still alive at their current size, each
    once, so a gradient autograd or FSDP holds counts and FSDP's freed all-gather buffers do not."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made += [weakref.ref(i) for i in inner_tensors(t)]
        return out

    def alive(self) -> int:
        storages = {}
        for ref in self.made:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def config(model: str, seq_len: int, microbatches: int, *extra: str) -> TrainConfig:
    keys = (f"+model={model}", "hardware=cpu", "dtype=fp32", f"seq_len={seq_len}", "dp=2", "dp_shard=2")
    return compose_config(*keys, "batch.micro=1", f"batch.global={2 * microbatches}", *extra)


def held_between_microbatches(
    rank: int, world: int, cfg: TrainConfig, options: tuple[str, ...], steps: int
) -> dict[str, dict[str, Any]]:
    """On each rank, per option: the bytes held at the start of micro-batches 2.. over those at the
    first (one metered step), the planner's gradient bytes for the rank, and the median step seconds
    (the options' steps interleaved, so both see the same machine load)."""
    torch.set_num_threads(1)
    layout = from_config(cfg, world)
    mesh = build_mesh(layout) if layout.world_size > 1 else None
    runner = build_runner(cfg.model, layout, mesh, build_options(cfg, layout), torch.device("cpu"))
    optimizer, _ = build_optimizer(runner.parts, cfg.optim, len(options) * (steps + 2))
    tokens = torch.randint(0, cfg.model.vocab_size, (layout.local_batch, cfg.seq_len + 1))
    starts: list[int] = []
    meter = HeldBytes()
    hook = runner.model.register_forward_pre_hook(lambda *_: starts.append(meter.alive()), prepend=True)

    def step(option: str, metered: bool) -> float:
        launcher.parallel.runner.set_gradient_sync = OPTIONS[option]
        starts.clear()
        t0 = time.perf_counter()
        with meter if metered else contextlib.nullcontext():
            runner.forward_backward(tokens[:, :-1], tokens[:, 1:])
        runner.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    planned = rank_memory(cfg.model, cfg.seq_len, layout, 4, "cpu", 0).grads
    times: dict[str, list[float]] = {option: [] for option in options}
    out = {}
    try:
        for _ in range(steps + 1):  # a warm-up, then `steps` timed
            for option in options:
                times[option].append(step(option, False))
        for option in options:
            meter.made.clear()
            step(option, True)
            held = [s - starts[0] for s in starts[1:]]
            out[option] = {"held": held, "planned": planned, "step_s": statistics.median(times[option][1:])}
    finally:
        hook.remove()
        launcher.parallel.runner.set_gradient_sync = RUNTIME
    return out


def main(argv: list[str]) -> None:
    from tests.dist import run

    parser = argparse.ArgumentParser(prog="python -m bench fsdp_accumulation")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per option (median), after one warm-up")
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    opts = parser.parse_args(argv)
    cfg = config(opts.model, opts.seq_len, opts.microbatches)
    print(f"{opts.model}, dp_shard=2 (gloo), fp32, {opts.microbatches} micro-batches of 1 x {opts.seq_len} per rank")
    print(f"{'option':<16} {'held MiB (rank 0, micro-batches 2..)':>36} {'planner MiB':>12} {'step s':>8}")
    ranks = run(held_between_microbatches, 2, cfg, tuple(OPTIONS), opts.steps, timeout=1800)
    for option in OPTIONS:
        held = " ".join(f"{h / 2**20:.3f}" for h in ranks[0][option]["held"])
        step = max(r[option]["step_s"] for r in ranks)
        print(f"{option:<16} {held:>36} {ranks[0][option]['planned'] / 2**20:>12.3f} {step:>8.3f}")
