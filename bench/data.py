"""Issue 28 figures: what mixing data costs. The loader's time per step, one source (BatchLoader) and a
mixture of three (MixLoader, odd weights), beside a training step of a small model on the same batch;
the per-source figures' cost beside it (per-token losses joined, summed by sequence and source); and the
schedule's one-time build at the largest period the weights may need; then document-masked attention
against plain causal at one shape (bench/attention_mask.py, which takes other shapes run alone)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench import attention_mask
from bench.spike import median_s
from launcher.config.layout_keys import from_config
from launcher.config.mix import MAX_PERIOD
from launcher.config.schema import compose_config as make_config
from launcher.data import BatchLoader, Splits
from launcher.data.mix import Mixture, Schedule, mix_loader
from launcher.metrics import sources
from launcher.parallel import build_runner
from launcher.planner import build_options

SHAPES = [("tiny", 8, 128), ("tiny", 64, 256), ("small", 8, 256)]  # model, sequences per step, seq_len
SHARES = [Fraction(47, 100), Fraction(31, 100), Fraction(22, 100)]


def corpus(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.uint16)


def row(model: str, batch: int, seq: int) -> list[str]:
    cfg = make_config(f"+model={model}", f"seq_len={seq}", f"batch.micro={batch}", "threads=1")
    layout = from_config(cfg, 1)
    runner = build_runner(cfg.model, layout, None, build_options(cfg, layout), torch.device("cpu"))
    parts = [corpus(4_000_000, s) for s in range(3)]
    plain = BatchLoader(parts[0], seq, batch)
    mixed = mix_loader(Mixture(["a", "b", "c"], SHARES, [Splits(p, p, 256) for p in parts]), "train", seq, batch, 0)
    plain_s, mix_s = median_s(plain.next_batch, 200), median_s(mixed.next_batch, 200)
    x, y = mixed.next_batch()

    def step() -> list[torch.Tensor]:
        with sources.recording(mixed) as kept:
            runner.forward_backward(x, y)
        for part in runner.parts:
            part.zero_grad(set_to_none=True)
        return kept

    kept = step()
    step_s = median_s(step, 3)
    # what the figures add to a step: the per-token losses joined, summed by sequence and by source
    figures_s = median_s(lambda: sources.sums(runner, mixed, [torch.cat(kept)]), 50)
    return [
        f"{model} {batch}x{seq}",
        f"{plain_s * 1e3:.3f}",
        f"{mix_s * 1e3:.3f}",
        f"{step_s * 1e3:.1f}",
        f"{mix_s / step_s:.2%}",
        f"{figures_s * 1e3:.3f}",
        f"{figures_s / step_s:.2%}",
    ]


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    table = Table(title="data mixtures: the loader's time per step beside the step (CPU, 1 thread)")
    for column in ("model, batch", "plain ms", "mix ms", "step ms", "mix / step", "figures ms", "figures / step"):
        table.add_column(column, justify="right")
    for shape in SHAPES:
        table.add_row(*row(*shape))
    console = Console()
    console.print(table)
    worst = [Fraction(1, 2**17), Fraction(1, 2**18) * 3, 1 - Fraction(5, 2**18)]  # a period of 2**18
    build_s = median_s(lambda: Schedule.build(worst, 0), 1)
    console.print(f"schedule build at the largest period ({MAX_PERIOD} sequences): {build_s:.2f} s, once per rank")
    attention_mask.main([])
