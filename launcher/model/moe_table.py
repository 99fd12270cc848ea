"""Per-layer expert load of a mixture of experts, as the step sums it: one row per MoE layer.

`balance_step` (launcher/model/moe.py) already sums each layer's token counts over the data-parallel
ranks; `layer_rows` lays this stage's layers out at their global index in a table of every layer,
zeros elsewhere, and that table rides in the tensor `balance_step` sums over pipeline stages anyway:
no extra collective. `layer_records` reads the summed table back as plain numbers, one dict per MoE
layer, which the metrics pack and show (launcher/metrics/moe_load.py). torch is imported where used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

EXTRA = 4  # columns after the experts': dropped picks, bias |mean|, 1 (a MoE layer), 1 if a capacity is set


class RoutedLayer(Protocol):  # launcher.model.moe.MoE, which imports this module
    layer: int
    expert_bias: torch.Tensor
    capacity_factor: float | None


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


def layer_records(rows: torch.Tensor) -> list[dict[str, Any]]:
    """The MoE layers of a table `layer_rows` built and the stages summed, in layer order: per layer its
    index ("layer"), the (token, expert) picks each expert ran ("tokens"), the picks over an expert's
    capacity ("dropped"; None: dropless) and its selection bias' mean |value| ("bias_abs_mean")."""
    records = []
    for i, row in enumerate(rows.tolist()):
        *tokens, dropped, bias, moe, capacity = row
        if moe:
            dropped = dropped if capacity else None
            records.append({"layer": i, "tokens": tokens, "dropped": dropped, "bias_abs_mean": bias})
    return records
