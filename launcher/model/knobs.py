"""A run's knobs: how a built model computes, beside what it computes (its ModelConfig). The
constructors take them (`Transformer(cfg, knobs)`, launcher/model/init.py `meta_model`), so nothing
sets them on a module afterwards. None of them changes a parameter: a checkpoint loads under any knobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.config.model import ModelConfig
from launcher.config.options import BuildOptions
from launcher.flops import expert_width
from launcher.ops.experts import select_impl

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Knobs:
    # the device's FLOP per byte, which sizes the chunked loss's chunks (flops.loss_chunk_rows); 0: 16 MiB of logits
    flop_per_byte: float = 0.0
    aux_scale: float = 1.0  # MoE auxiliary losses' gradient per micro-batch: 1 / the step's micro-batches
    expert_impl: str = "loop"  # the routed experts' kernel: loop | grouped_mm (ops/experts.py `select_impl`)


PLAIN = Knobs()  # a model built without a run (tests, export, generation): plain loss chunks, the loop


def run_knobs(cfg: ModelConfig, options: BuildOptions, microbatches: int, device: torch.device) -> Knobs:
    """The knobs of a run of `cfg` with `options`, `microbatches` per step (the layout's) on `device`."""
    impl = select_impl(cfg.dim, expert_width(cfg), device, options.precision != "fp32") if cfg.moe.experts else "loop"
    return Knobs(options.flop_per_byte, 1.0 / microbatches, impl)
