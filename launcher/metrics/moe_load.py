"""Per-layer expert load of a mixture of experts, shown: the rich panel's table (`metrics.moe_table=true`)
and wandb's histograms of tokens per expert. The step sums each layer's load as plain numbers
(launcher/model/moe_table.py `layer_records`); `layer_loads` packs them here. rich is imported where
used: the sinks import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

HISTOGRAM_BINS = 512  # wandb.Histogram's most bins: more experts than that are shown as a distribution


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


def layer_loads(records: Sequence[Mapping[str, Any]]) -> list[LayerLoad]:
    """The step's per-layer records (plain numbers: model/moe_table.py `layer_records`) as `LayerLoad`s."""
    return [LayerLoad(**record) for record in records]


def load_table(loads: Sequence[LayerLoad]) -> Table:
    """The panel's table: one row per MoE layer."""
    from rich.table import Table

    capacity = any(load.dropped is not None for load in loads)
    table = Table(title="MoE load per layer (tokens per expert, this step)", header_style="bold")
    labels = ["layer", "max/mean", "min", "max", "bias |mean|"] + (["dropped"] if capacity else [])
    for label in labels:
        table.add_column(label, justify="right")
    for load in loads:
        cells = [str(load.layer), f"{load.imbalance:.2f}", f"{min(load.tokens):,.0f}", f"{max(load.tokens):,.0f}"]
        cells.append(f"{load.bias_abs_mean:.2e}")
        if capacity:
            cells.append(f"{load.dropped_share:.1%}" if load.dropped_share is not None else "-")
        table.add_row(*cells)
    return table


def load_histograms(loads: Sequence[LayerLoad], wandb: Any) -> dict[str, Any]:
    """Per layer, a bar per expert (its tokens): `moe_tokens_per_expert/layer_N`."""
    charts = {}
    for load in loads:
        experts = len(load.tokens)
        if experts <= HISTOGRAM_BINS:
            chart = wandb.Histogram(np_histogram=(load.tokens, list(range(experts + 1))))
        else:
            chart = wandb.Histogram(load.tokens, num_bins=HISTOGRAM_BINS)
        charts[f"moe_tokens_per_expert/layer_{load.layer}"] = chart
    return charts
