"""Which tokens of each sequence a context-parallel rank holds: the data loader hands each cp rank its
share (`split_sequence`), and the attention over the cp group reads the same rule
(launcher/parallel/context.py).

Load balancing: a sequence of S tokens is cut into 2 cp equal chunks; cp rank i holds chunks i and
2 cp - 1 - i. Under a causal mask a query attends to the keys before it, so a rank with an early
chunk also holds a late one, and every rank does the same attention work.
"""

from __future__ import annotations

from functools import cache

import torch


def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The global chunks (of 2 cp) cp rank `rank` holds, in local order: one early, its mirror late."""
    return rank, 2 * cp - 1 - rank


@cache
def _positions(seq_len: int, cp: int, rank: int) -> tuple[int, ...]:
    chunk = seq_len // (2 * cp)
    return tuple(p for c in rank_chunks(cp, rank) for p in range(c * chunk, (c + 1) * chunk))


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of cp rank `rank`'s tokens of an S-token sequence: chunks rank and
    2 cp - 1 - rank of 2 cp (layout.violations has checked that 2 cp divides S)."""
    return torch.tensor(_positions(seq_len, cp, rank), dtype=torch.long)


def split_sequence(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's tokens of (batch, seq, ...) rows: what the data loader hands it."""
    return t if cp == 1 else t[:, local_positions(t.shape[1], cp, rank)]
