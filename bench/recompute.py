"""Recompute modes against the planner: `python -m bench recompute [--seq-len 128] [--steps 6] [--batch 8]`.

1. Memory (exact): the bytes one block (or a stage of blocks) keeps from its forward for its backward,
   per mode (none, selective, full; recompute_layers=1 under none and selective), against the
   planner's `layer_activation_bytes` x tokens. Measured as the storages an op made in forward that are
   still alive after it (a TorchDispatchMode holding weak references: what autograd's graph and the
   selective-checkpoint cache keep, whichever holds them), plus the block's input, which every mode
   keeps. With recompute=none this equals the saved-tensor-hook count (checked in the tests). tp=1 in
   this process, tp=2 in two gloo processes.
2. FLOP overhead: FLOPs of forward + backward of one block per mode (torch's FlopCounterMode: matmuls
   and attention), as a ratio to recompute=none, next to the planner's (flops.py).
3. Step time: the `small` model in one process on one thread, recompute none / selective / full /
   recompute_layers=2, steps of each mode interleaved in one run (the same machine load), as ratios
   to none next to the planner's. CPU seconds of this process per step (time.process_time) as well as
   wall seconds: on a shared, oversubscribed machine wall time mostly measures the other tenants.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.parallel import train_step
from launcher.compat.torch_compat import inner_tensors
from launcher.config.layout_keys import from_config
from launcher.config.schema import TrainConfig, compose_config
from launcher.flops import head_dim
from launcher.layout import Layout, build_mesh
from launcher.model.attention import rope_tables
from launcher.model.transformer import Block
from launcher.parallel import build_runner
from launcher.parallel.recompute import apply_recompute
from launcher.planner import build_options, resolve
from launcher.planner.activations import layer_activation_bytes
from launcher.train.optim import build_optimizer

MODES = (  # name, recompute, recompute_layers, blocks in the stage
    ("none", "none", 0, 1),
    ("selective", "selective", 0, 1),
    ("full", "full", 0, 1),
    ("layers=1 of 2, none", "none", 1, 2),
    ("layers=1 of 2, selective", "selective", 1, 2),
)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind `t` (a DTensor's: its local shard's)."""
    return [i.untyped_storage() for i in inner_tensors(t)]


def _ptrs(tensors: Any) -> set[int]:
    return {s.data_ptr() for t in tensors for s in _storages(t)}


class HeldBytes(TorchDispatchMode):
    """Weak references to the storage of every tensor an op makes inside `with HeldBytes():`."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.made += [(s.data_ptr(), StorageWeakRef(s), s.nbytes()) for s in _storages(t)]
        return out

    def alive(self, exclude: set[int]) -> int:
        """Bytes of the storages made here that are still alive, each once, but those in `exclude`."""
        alive = {ptr: size for ptr, ref, size in self.made if not ref.expired() and ptr not in exclude}
        return sum(alive.values())


def held_bytes(blocks: list[nn.Module], rope: torch.Tensor, x: torch.Tensor) -> int:
    """Bytes the blocks keep from forward for backward: what ops made and is alive after forward (not
    parameters, the RoPE table or the output), plus the input (kept by every mode). Runs backward after."""
    meter = HeldBytes()
    with meter:
        out = x
        for block in blocks:
            out = block(out, rope)
    gc.collect()  # garbage in reference cycles (the rest of a process's work) is not held for backward
    exclude = _ptrs([p for b in blocks for p in b.parameters()] + [rope, out, x])
    held = meter.alive(exclude) + sum(s.nbytes() for s in _storages(x))
    out.sum().backward()
    return held


class Stage(nn.Module):
    """Blocks as a pipeline stage holds them (`apply_recompute` wraps `layers` in place)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})


def config(seq_len: int, tp: int = 1, *overrides: str) -> TrainConfig:
    return compose_config("+model=small", "hardware=cpu", f"tp={tp}", f"seq_len={seq_len}", "batch.micro=1", *overrides)


def predicted_bytes(cfg: TrainConfig, lay: Layout, blocks: int) -> float:
    """The planner's saved bytes for `blocks` blocks of one 1-sequence microbatch."""
    m, seq = cfg.model, cfg.seq_len
    full = lay.full_layers(blocks)
    per_token = layer_activation_bytes(m, seq, lay, 4)[0] * (blocks - full)
    per_token += layer_activation_bytes(m, seq, replace(lay, recompute="full"), 4)[0] * full
    return per_token * seq


def memory_rows(seq_len: int) -> list[dict[str, Any]]:
    """tp=1: every mode of MODES, predicted and held bytes."""
    cfg = config(seq_len)
    m = cfg.model
    rope = rope_tables(head_dim(m), m.max_seq_len, m.rope_theta, torch.device("cpu"))
    rows = []
    for name, recompute, layers, n in MODES:
        torch.manual_seed(0)
        stage = Stage([Block(m) for _ in range(n)])
        lay = replace(from_config(cfg, 1), recompute=recompute, recompute_layers=layers)
        apply_recompute(stage, lay)
        x = torch.randn(1, seq_len, m.dim, requires_grad=True)
        held = held_bytes(list(stage.layers.values()), rope, x)
        rows.append({"tp": 1, "mode": name, "predicted": predicted_bytes(cfg, lay, n), "held": held})
    return rows


def tp2_memory_worker(rank: int, world: int, seq_len: int) -> list[dict[str, Any]]:
    """tp=2: one block of the tensor-parallel model per mode (none, selective, full)."""
    rows = []
    for recompute in ("none", "selective", "full"):
        cfg = config(seq_len, 2, f"recompute={recompute}")
        lay = from_config(cfg, world)
        runner = build_runner(cfg.model, lay, build_mesh(lay), build_options(cfg, lay), torch.device("cpu"))
        model = runner.parts[0]
        torch.manual_seed(0)
        x = torch.randn(1, seq_len, cfg.model.dim, requires_grad=True)
        held = held_bytes([model.layers["0"]], model.rope, x)
        rows.append({"tp": 2, "mode": recompute, "predicted": predicted_bytes(cfg, lay, 1), "held": held})
    return rows


def all_memory_rows(seq_len: int) -> list[dict[str, Any]]:
    from tests.dist import run

    return memory_rows(seq_len) + run(tp2_memory_worker, 2, seq_len, timeout=300)[0]


def flop_rows(seq_len: int) -> list[dict[str, Any]]:
    """Forward + backward FLOPs of 4 blocks per mode, over none's, measured and planned."""
    from torch.utils.flop_counter import FlopCounterMode

    from launcher.flops import hardware_flops_per_token
    from launcher.planner.memory import recomputed_layers

    cfg = config(seq_len, 1, "model.n_layers=4")
    m = cfg.model
    rope = rope_tables(head_dim(m), m.max_seq_len, m.rope_theta, torch.device("cpu"))
    modes = (("none", "none", 0), ("selective", "selective", 0), ("layers=1", "none", 1), ("full", "full", 0))
    counted, rows = {}, []
    for name, recompute, layers in modes:
        torch.manual_seed(0)
        stage = Stage([Block(m) for _ in range(m.n_layers)])
        lay = replace(from_config(cfg, 1), recompute=recompute, recompute_layers=layers)
        apply_recompute(stage, lay)
        x = torch.randn(1, seq_len, m.dim, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            out = x
            for block in stage.layers.values():
                out = block(out, rope)
            out.sum().backward()
        counted[name] = counter.get_total_flops()
        out_flops = 6.0 * m.vocab_size * m.dim  # the planner's figure includes the output layer
        planned = hardware_flops_per_token(m, seq_len, recomputed_layers(m.n_layers, lay)) - out_flops
        rows.append({"mode": name, "measured": counted[name], "planned_per_token": planned})
    for r in rows:
        r["measured_ratio"] = r["measured"] / counted["none"]
        r["planned_ratio"] = r["planned_per_token"] / rows[0]["planned_per_token"]
    return rows


def step_rows(seq_len: int, batch: int, steps: int) -> list[dict[str, Any]]:
    """`small` in one process, each mode timed in turn (interleaved steps: the same machine load)."""
    modes = (("none", "recompute=none"), ("selective", "recompute=selective"), ("full", "recompute=full"))
    modes += (("layers=2 of 4", "recompute_layers=2"),)
    runs = []
    for name, override in modes:
        cfg = compose_config("+model=small", "hardware=cpu", f"seq_len={seq_len}", f"batch.global={batch}",
                             f"batch.micro={batch}", override)  # fmt: skip
        lay, prediction, _ = resolve(cfg, 1)
        runner = build_runner(cfg.model, lay, None, build_options(cfg, lay), torch.device("cpu"))
        optimizer, _ = build_optimizer(runner.parts, cfg.optim, 100)
        runs.append((name, runner, optimizer, prediction.step_time_s, []))
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for step in range(steps + 1):
        tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=gen)
        for _, runner, optimizer, _, times in runs:
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(runner, optimizer, tokens)
            if step:  # the first is warm-up
                times.append((time.perf_counter() - t0, time.process_time() - c0))
    torch.set_num_threads(threads)
    wall, cpu = ({name: statistics.median(t[i] for t in times) for name, *_, times in runs} for i in (0, 1))
    base = runs[0][0]
    return [
        {"mode": name, "wall": wall[name], "cpu": cpu[name], "predicted": pred, "wall_ratio": wall[name] / wall[base],
         "cpu_ratio": cpu[name] / cpu[base], "predicted_ratio": pred / runs[0][3]}
        for name, _, _, pred, _ in runs
    ]  # fmt: skip


def main(argv: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="python -m bench recompute", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (step time)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode (median)")
    args = parser.parse_args(argv)
    console = Console(width=None if Console().is_terminal else 140)

    table = Table(title=f"saved activations, small (SwiGLU, GQA 8/4), 1 x {args.seq_len}, fp32: planner vs held")
    for col in ("tp", "mode", "predicted KiB", "held KiB", "exact"):
        table.add_column(col, justify="right")
    for r in all_memory_rows(args.seq_len):
        ok = r["predicted"] == r["held"]
        table.add_row(str(r["tp"]), r["mode"], f"{r['predicted'] / 1024:.1f}", f"{r['held'] / 1024:.1f}",
                      "[green]yes[/]" if ok else "[red]no[/]")  # fmt: skip
    console.print(table)

    table = Table(title=f"FLOPs of forward + backward, 4 blocks of small, 1 x {args.seq_len} (FlopCounterMode)")
    for col in ("mode", "measured GFLOP", "measured / none", "planner / none"):
        table.add_column(col, justify="right")
    for r in flop_rows(args.seq_len):
        table.add_row(
            r["mode"], f"{r['measured'] / 1e9:.3f}", f"{r['measured_ratio']:.3f}", f"{r['planned_ratio']:.3f}"
        )
    console.print(table)

    table = Table(title=f"step time, small, 1 process, 1 thread, {args.batch} x {args.seq_len}, median of {args.steps}")
    for col in ("mode", "CPU s", "CPU / none", "wall s", "wall / none", "predicted s", "predicted / none"):
        table.add_column(col, justify="right")
    for r in step_rows(args.seq_len, args.batch, args.steps):
        keys = ("cpu", "cpu_ratio", "wall", "wall_ratio", "predicted", "predicted_ratio")
        table.add_row(r["mode"], *(f"{r[k]:.3f}" for k in keys))
    console.print(table)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
