"""torch.compile per block, and what it did.

Each block is compiled on its own, in place (names unchanged), as torchtitan does: after tensor
parallelism and recompute, which it traces (DTensor ops, the checkpointed forward), and before data
parallelism, whose hooks stay outside the graphs. A MoE layer's token counts and all-to-all splits are
data-dependent, so there the norms and attention are compiled and the experts run eagerly.

The compiled path is the product, so what compile did is measured, not assumed: dynamo's count of
graphs and graph breaks (`CompileReport`), which a run prints and writes into summary.json after its
first step. One graph per compiled unit and no break is what every block kind gives today
(tests/unit/test_compile.py); a break means that part of the block ran eagerly, unfused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from launcher.compat.compile_compat import compile_counts
from launcher.model.moe import moe_layers


def compiled_units(block: nn.Module) -> tuple[nn.Module, ...]:
    """The modules of `block` compiled as one graph each: the block, or around a MoE layer its parts."""
    if moe_layers([block.feed_forward]):
        return block.attention_norm, block.attention, block.ffn_norm
    return (block,)


def compile_blocks(model: nn.Module, backend: str = "inductor") -> None:
    """Compile every block of `model` (a whole model or a pipeline stage) in place."""
    quiet_checkpoint_notice()
    for block in model.layers.values():
        for unit in compiled_units(block):
            unit.compile(backend=backend)
    embedding = model.tok_embeddings
    if embedding is not None and isinstance(embedding.weight, DTensor):
        embedding.register_forward_hook(_fresh_output)


def quiet_checkpoint_notice() -> None:
    """torch warns, on every rank, that a checkpoint with a policy (selective recompute) is compiled and
    must hold no in-place op: the compiled blocks hold none (launcher/ops/pointwise.py's in-place
    nodes are eager's only), so the four lines a rank are dropped; every other warning stays."""
    wrap_log = logging.getLogger("torch._higher_order_ops.wrap")
    if checkpoint_notice not in wrap_log.filters:
        wrap_log.addFilter(checkpoint_notice)


def checkpoint_notice(record: logging.LogRecord) -> bool:
    return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _fresh_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """A copy of the tensor-parallel embedding's output. It is the view `DTensor.to_local()` returns,
    and a compiled block that takes such a view as its input sends the view's gradient on to the
    embedding's redistribution as a plain tensor, which fails there in backward (torch 2.11 to 2.15;
    2.13: `'Tensor' object has no attribute '_local_tensor'`); a copy is one pass over (batch, seq, dim)."""
    return output.clone()


@dataclass(frozen=True)
class CompileReport:
    """What dynamo did in this process: graphs compiled and graph breaks (by reason's first line)."""

    units: int  # modules compiled (blocks, or a MoE block's parts)
    graphs: int
    breaks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def now(cls, units: int) -> CompileReport:
        graphs, breaks = compile_counts()
        first_lines: dict[str, int] = {}
        for reason, n in breaks.items():
            line = reason.strip().splitlines()[0] if reason.strip() else "unknown"
            first_lines[line] = first_lines.get(line, 0) + n
        return cls(units, graphs, first_lines)

    @property
    def n_breaks(self) -> int:
        return sum(self.breaks.values())

    def line(self) -> str:
        """One line for people: fine, or which break made part of a block run eagerly."""
        graphs = f"{self.graphs} graph{'s' * (self.graphs != 1)}"
        head = f"compile: {self.units} module{'s' * (self.units != 1)} compiled into {graphs}"
        if not self.n_breaks:
            return f"{head}, no graph break"
        reason, count = max(self.breaks.items(), key=lambda kv: kv[1])
        eager = "parts of blocks run eagerly, unfused"
        return f"{head}, {self.n_breaks} graph breaks: {eager} (most often, {count}x: {reason})"

    def summary(self) -> dict:
        return {"units": self.units, "graphs": self.graphs, "graph_breaks": self.n_breaks, "break_reasons": self.breaks}
