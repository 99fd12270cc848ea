"""Figures per source of a mixture (data=mix): loss and tokens each step, validation loss, the realised
shares. From the per-token losses the pass computes anyway (`loss.token_losses`), summed per sequence
and grouped by the loader's source of each sequence: no extra pass, one small all-reduce a step."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from launcher.data import BatchLoader
from launcher.data.mix import MixLoader
from launcher.ops.loss import token_losses


class SumsBySource(Protocol):  # launcher.parallel.runner.Runner: metrics sits under parallel/ and names no runner
    def source_sums(self, per_token: list[torch.Tensor], sources: torch.Tensor, k: int) -> torch.Tensor: ...


def recording(loader: BatchLoader) -> contextlib.AbstractContextManager[list[torch.Tensor] | None]:
    """Around a pass over the loader's last batch: the per-token losses for `figures` (a mixture's)."""
    return token_losses() if isinstance(loader, MixLoader) else contextlib.nullcontext()


def sums(runner: SumsBySource, loader: BatchLoader, recorded: list[torch.Tensor] | None) -> torch.Tensor | None:
    """(sources, 2): summed loss and tokens of each source over the pass's batch on every rank."""
    if recorded is None or not isinstance(loader, MixLoader):
        return None
    return runner.source_sums(recorded, torch.as_tensor(loader.sources), len(loader.labels))


def figures(loader: BatchLoader, table: torch.Tensor | None, prefix: str = "", tokens: bool = True) -> dict[str, Any]:
    """`loss.LABEL` (the mean over the source's tokens; absent when it had none) and `tokens.LABEL`."""
    if table is None or not isinstance(loader, MixLoader):
        return {}
    row: dict[str, Any] = {}
    for label, (loss_sum, count) in zip(loader.labels, table.tolist()):
        if count:
            row[f"{prefix}loss.{label}"] = loss_sum / count
        if tokens:
            row[f"tokens.{label}"] = int(count)
    return row


def realised_shares(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """For the summary: each source's tokens trained over the run's steps and its share of them."""
    totals: dict[str, int] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("tokens."):
                totals[key] = totals.get(key, 0) + value
    everything = sum(totals.values())
    shares = {f"share.{key.removeprefix('tokens.')}": n / everything for key, n in totals.items() if everything}
    return totals | shares
