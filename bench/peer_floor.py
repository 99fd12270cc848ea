"""The floor under issue 15's peer shape: `python -m bench peer_floor`.

Any trainer running this model in fp32 on this CPU calls the same two kernels for most of its step:
SDPA's flash attention (forward and backward) and the matmuls of the linear layers (forward, input
gradient, weight gradient). This bench times those kernels alone, in this process, at each layout's
per-rank shape (heads, widths and vocabulary halved under tp=2) with that layout's threads per rank,
in as many processes at once as the layout has ranks (they share the cores and the memory bus as
the ranks do), times a fresh `train` run of the same layout, and prints the step time left for
everything else and the ceiling on any speedup that leaves the two kernels as they are (step / the
slowest rank's floor). Rounds alternate the layouts in fresh processes; each figure is the best
over them (the fastest step after the first of each run, the fastest kernels): sharing a busy host
only lengthens either.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from bench.fsdp_cpu import BATCH, peer_config
from bench.peer_shape import LAYOUTS, ROOT, run

PEER = peer_config(1, [])
M, SEQ = PEER.model, PEER.seq_len
DIM, LAYERS, HEADS, FFN, VOCAB = M.dim, M.n_layers, M.n_heads, M.ffn_dim, M.vocab_size
# (tensor-parallel degree, threads per rank, ranks); FSDP's ranks each run the whole model on their batch
RANKS = {"1 process": (1, 2, 1), "tp=2": (2, 1, 2), "fsdp dp_shard=2": (1, 1, 2)}


def best(fn: Callable[[], object], trials: int = 3) -> float:
    fn()  # warm-up: first-touch pages, kernel selection
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_s(tp: int) -> float:
    """One layer's causal SDPA forward + backward at the per-rank heads."""
    q, k, v = (torch.randn(BATCH, HEADS // tp, SEQ, DIM // HEADS, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    return best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad))


def matmuls_s(tp: int) -> float:
    """Every linear layer's three matmuls (output, input gradient, weight gradient) for one step."""
    tokens = BATCH * SEQ
    # (in, out) per rank: fused QKV and gate+up split by columns, wo and w2 by rows, the head by vocabulary
    layer = [(DIM, 3 * DIM // tp), (DIM // tp, DIM), (DIM, 2 * FFN // tp), (FFN // tp, DIM)]
    total = 0.0
    for (n_in, n_out), count in [*((shape, LAYERS) for shape in layer), ((DIM, VOCAB // tp), 1)]:
        x, w, g = torch.randn(tokens, n_in), torch.randn(n_out, n_in), torch.randn(tokens, n_out)
        total += count * best(lambda x=x, w=w, g=g: (x @ w.t(), g @ w, g.t() @ x))
    return total


def kernels_s(tp: int, threads: int) -> tuple[float, float]:
    """(SDPA, matmuls) seconds of one rank's step."""
    torch.set_num_threads(threads)
    return LAYERS * attention_s(tp), matmuls_s(tp)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench peer_floor")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (fresh processes each)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    opts = parser.parse_args(argv)
    spawn = multiprocessing.get_context("spawn")
    kernels: dict[str, list[tuple[float, float]]] = {name: [] for name in LAYOUTS}
    steps: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            for i, (name, layout) in enumerate(LAYOUTS.items()):
                tp, threads, ranks = RANKS[name]
                with spawn.Pool(ranks) as pool:
                    kernels[name].append(max(pool.starmap(kernels_s, [(tp, threads)] * ranks), key=sum))
                # seconds per step of the fastest one: each of the ranks // tp replicas runs BATCH sequences
                best = run(ROOT, layout, opts.steps, Path(tmp), f"floor-{i}-{r}")[3]
                steps[name].append(ranks // tp * BATCH * SEQ / best)
    title = f"peer shape: the step against the kernels every trainer shares (s per step, best of {opts.rounds} rounds)"
    table = Table(title=title)
    for col in ("layout", "step", "SDPA fwd+bwd", "matmuls", "everything else", "ceiling (step / floor)"):
        table.add_column(col, justify="right")
    for name in LAYOUTS:
        step, (sdpa, mm) = min(steps[name]), min(kernels[name], key=sum)
        rest = step - sdpa - mm
        table.add_row(name, f"{step:.2f}", f"{sdpa:.2f}", f"{mm:.2f}", f"{rest:.2f}", f"{step / (sdpa + mm):.2f}x")
    Console().print(table)
