"""Per-layer expert load of a mixture of experts, as the step sums it: one row per MoE layer.

`balance_step` (launcher/model/moe.py) already sums each layer's token counts over the data-parallel
ranks; `layer_rows` lays this stage's layers out at their global index in a table of every layer,
zeros elsewhere, and that table rides in the tensor `balance_step` sums over pipeline stages anyway:
no extra collective. `layer_loads` reads the summed table back as plain numbers (`LayerLoad`), which
the metrics show (launcher/metrics/moe_load.py). torch is imported where used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

EXTRA = 4  # columns after the experts': dropped picks, bias |mean|, 1 (a MoE layer), 1 if a capacity is set


class RoutedLayer(Protocol):  # launcher.model.moe.MoE, which imports this module
    layer: int
    expert_bias: torch.Tensor
    capacity_factor: float | None


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's routing over a step's global batch."""

    layer: int
    tokens: list[float]  # (token, expert) picks each expert ran, summed over the data-parallel ranks
    dropped: float | None  # picks over an expert's capacity; None: dropless (no capacity_factor)
    bias_abs_mean: float

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean (what moe_load_imbalance averages over layers)."""
        return max(self.tokens) / max(sum(self.tokens) / len(self.tokens), 1e-9)

    @property
    def dropped_share(self) -> float | None:
        if self.dropped is None:
            return None
        return self.dropped / max(sum(self.tokens) + self.dropped, 1.0)


def layer_rows(
    layers: Sequence[RoutedLayer], counts: torch.Tensor, dropped: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """(n_layers, experts + EXTRA) for `shape` = (n_layers, experts): each of `layers` at its global
    index, with its counts (rows of `counts`, `dropped`), zeros at every other layer."""
    import torch

    rows = counts.new_zeros(shape[0], shape[1] + EXTRA)
    if layers:
        biases = torch.stack([m.expert_bias.abs().mean() for m in layers])
        flags = counts.new_tensor([[1.0, float(m.capacity_factor is not None)] for m in layers])
        columns = torch.cat([dropped[:, None], biases[:, None], flags], 1)
        rows[[m.layer for m in layers]] = torch.cat([counts, columns], 1)
    return rows


def layer_loads(rows: torch.Tensor) -> list[LayerLoad]:
    """The MoE layers of a table `layer_rows` built and the stages summed, in layer order."""
    loads = []
    for i, row in enumerate(rows.tolist()):
        *tokens, dropped, bias, moe, capacity = row
        if moe:
            loads.append(LayerLoad(i, tokens, dropped if capacity else None, bias))
    return loads
