"""Parallelism is applied here, in one place and in a fixed order:
pipeline split → tensor parallel → activation checkpointing → compile → data parallel.

`parallelize` returns a `Runner`: the rank's model parts plus the three operations the training
loop needs (forward+backward over a step's batch, evaluation, gradient clipping). The loop never
sees how the model is cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from launcher.config import TrainConfig
from launcher.layout import Layout


class Runner:
    """One process, no parallelism: gradient accumulation over micro-batches."""

    def __init__(self, model: nn.Module, micro: int, autocast: torch.autocast | None = None) -> None:
        self.parts: list[nn.Module] = [model]
        self.model = model
        self.micro = micro
        self.autocast = autocast

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast or torch.autocast("cpu", enabled=False):
            logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Accumulate gradients of the mean loss over this rank's batch; return that mean loss."""
        chunks = list(zip(inputs.split(self.micro), targets.split(self.micro)))
        total = 0.0
        for x, y in chunks:
            loss = self._loss(x, y) / len(chunks)
            loss.backward()
            total += loss.item()
        return total

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        losses = [self._loss(x, y).item() for x, y in zip(inputs.split(self.micro), targets.split(self.micro))]
        return sum(losses) / len(losses)

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for part in self.parts for p in part.parameters()]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))


def parallelize(model: nn.Module, layout: Layout, cfg: TrainConfig, autocast: torch.autocast | None) -> Runner:
    if layout.world_size != 1:
        raise NotImplementedError("parallel layouts are not implemented yet")
    return Runner(model, cfg.batch["micro"], autocast)
