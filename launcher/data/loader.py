"""Deterministic, resumable batches, sharded over data-parallel ranks.

Sample i of a run (counting over all ranks) starts at a pseudo-random offset that depends only on
(seed, i), so the stream is the same whatever the data-parallel size: rank r of D takes the r-th
contiguous share of each global batch. Context-parallel ranks of one dp rank read the same sequences
and keep their own chunks of each (`context_split.split_sequence`). The state is the samples consumed, which
is why a run can resume under a different data-parallel degree and see the same next samples, and the
global batches never to serve (a loss spike's, launcher/train/spike.py): a run that skips batch n trains
its step n on batch n + 1, exactly as a run whose data never held batch n.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from launcher.config.mix import check_resumed_mix
from launcher.data.context_split import split_sequence

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A counter-based hash (Steele et al. 2014): uniform 64-bit values from consecutive integers."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return z ^ (z >> np.uint64(31))


def min_tokens(seq_len: int) -> int:
    """The shortest split a sample fits in: seq_len inputs, the targets shifted by one, and at least
    one start offset to draw."""
    return seq_len + 2


def sample_offsets(seed: int, first: int, count: int, n_tokens: int, seq_len: int) -> np.ndarray:
    return offsets_of(seed, np.arange(first, first + count), n_tokens, seq_len)


def offsets_of(seed: int, samples: np.ndarray, n_tokens: int, seq_len: int) -> np.ndarray:
    """The start offsets of samples number `samples` of the stream `seed`."""
    span = n_tokens - min_tokens(seq_len) + 1  # start offsets that leave room for inputs and shifted targets
    idx = samples.astype(np.uint64) + np.uint64(seed) * np.uint64(1 << 40)
    return (splitmix64(idx) % np.uint64(span)).astype(np.int64)


def gather(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets])
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


@dataclass
class BatchLoader:
    tokens: np.ndarray
    seq_len: int
    global_batch: int  # sequences per step over all data-parallel ranks
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    cp_rank: int = 0
    cp_size: int = 1
    position: int = 0  # global samples consumed so far
    skipped: list[list[int]] = field(default_factory=list)  # [first, last] global batch numbers never served

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def batch_number(self) -> int:
        """The global batch served last, numbered from 1: batch n holds samples (n-1) x global_batch onwards."""
        return self.position // self.global_batch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch not skipped: inputs and targets, (local_batch, seq_len / cp)."""
        while any(first <= self.batch_number + 1 <= last for first, last in self.skipped):
            self.position += self.global_batch
        inputs, targets = self.draw(self.position + self.dp_rank * self.local_batch, self.local_batch)
        self.position += self.global_batch
        return split_sequence(inputs, self.cp_size, self.cp_rank), split_sequence(targets, self.cp_size, self.cp_rank)

    def draw(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples first .. first + count - 1, whole: inputs and targets, (count, seq_len)."""
        offsets = sample_offsets(self.seed, first, count, self.tokens.size, self.seq_len)
        return gather(self.tokens, offsets, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "skipped": [list(r) for r in self.skipped]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_resumed_mix(state, None)  # a mixture's position read by one source (MixLoader strips it)
        self.position, self.seed = int(state["position"]), int(state["seed"])
        self.skipped = [[int(first), int(last)] for first, last in state.get("skipped", [])]  # older: none
