"""Weighted mixtures (`data=mix`): a fixed schedule of which source fills each sequence, and the loader.

The schedule: global sample j of a phase goes to source `table[j % period]`, a table built once per
rank by largest deficit (the source furthest below its share takes the next sequence; ties in a
seeded order). So after any n sequences of a phase every source has had its share of them to within
one sequence (n x share, rounded either way), hence over any window of sequences (or steps) to within
two; exactly one for every window is impossible for three or more unequal weights (balanced words,
Fraenkel's conjecture, proved for up to seven letters). The schedule is the same for every layout and
data-parallel size: rank r of D takes the r-th contiguous share of each global batch, as BatchLoader.
Source s's k-th sequence is drawn as a plain loader would its k-th sample, from the source's own
seed; where sample j falls in its source follows from j alone (the table's running counts).

The state is a few numbers: the position, seed and skipped batches of BatchLoader, plus the phase:
the sample where the current weights began and each source's sequences consumed before it. A run
resumed with other weights starts a new phase there (and says so); one with the same weights goes on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from launcher.config.mix import Source, check_resumed_mix, mixture_sources, period, shares
from launcher.config.schema import DataConfig
from launcher.data.corpus import Splits, check_source, load_splits
from launcher.data.loader import BatchLoader, offsets_of
from launcher.errors import LauncherError


@dataclass(frozen=True)
class Schedule:
    """Which source fills each sample of a phase, computable for any sample without replaying."""

    table: np.ndarray  # (period,) the source of each sample of a period
    before: np.ndarray  # (period + 1, sources) each source's samples before that slot of the period
    per_period: np.ndarray  # (sources,) samples of each source per period

    @classmethod
    def build(cls, fractions: list[Fraction], seed: int) -> Schedule:
        p = math.lcm(*(f.denominator for f in fractions))
        quota = [int(f * p) for f in fractions]  # samples per period; they sum to p
        rank = np.random.default_rng(seed).permutation(len(quota)).tolist()  # the seeded order of ties
        counts, table = [0] * len(quota), np.empty(p, dtype=np.int64)
        for n in range(p):  # the deficit of source s before sample n, in units of 1 / p
            s = max(range(len(quota)), key=lambda s: ((n + 1) * quota[s] - counts[s] * p, -rank[s]))
            table[n], counts[s] = s, counts[s] + 1
        before = np.zeros((p + 1, len(quota)), dtype=np.int64)
        np.cumsum(np.eye(len(quota), dtype=np.int64)[table], axis=0, out=before[1:])
        return cls(table, before, np.asarray(quota, dtype=np.int64))

    def at(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For samples of the phase (numbered from 0): each one's source and its number in that source."""
        slot, periods = samples % len(self.table), samples // len(self.table)
        source = self.table[slot]
        return source, periods * self.per_period[source] + self.before[slot, source]

    def consumed(self, samples: int) -> np.ndarray:
        """Each source's samples among the phase's first `samples`."""
        periods, slot = divmod(samples, len(self.table))
        return periods * self.per_period + self.before[slot]


def source_seed(seed: int, source: int) -> int:
    """Each source's own stream of samples (a prime stride: distinct from the loaders' seed and seed + 1)."""
    return seed + (source + 1) * 1_000_003


@dataclass
class MixLoader(BatchLoader):
    """BatchLoader over several sources (`parts`, one token array each); `tokens` is unused.
    After each batch, `sources` holds the source of each of this rank's sequences."""

    parts: list[np.ndarray] = field(default_factory=list)
    fractions: list[Fraction] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    phase_start: int = 0  # the global sample the current weights began at
    base: list[int] = field(default_factory=list)  # each source's samples consumed before phase_start
    note: str | None = None  # a resume that began a new phase: the line the run prints
    sources: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        self.base = self.base or [0] * len(self.parts)
        self.schedule = Schedule.build(self.fractions, self.seed)

    def draw(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        source, index = self.schedule.at(np.arange(first, first + count) - self.phase_start)
        index = index + np.asarray(self.base)[source]
        rows = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(source):
            tokens, picked = self.parts[s], source == s
            offsets = offsets_of(source_seed(self.seed, int(s)), index[picked], tokens.size, self.seq_len)
            rows[picked] = np.stack([np.asarray(tokens[o : o + self.seq_len + 1], dtype=np.int64) for o in offsets])
        self.sources = source
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def consumed(self) -> list[int]:
        """Each source's samples before `position` (over all ranks; skipped batches count as consumed)."""
        return (np.asarray(self.base) + self.schedule.consumed(self.position - self.phase_start)).tolist()

    def state_dict(self) -> dict[str, Any]:
        phase = {"labels": self.labels, "weights": [str(f) for f in self.fractions], "start": self.phase_start}
        return super().state_dict() | {"mix": phase | {"consumed_at_start": list(self.base)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "mix"})
        phase = state.get("mix")
        if phase is None:  # a single-source run's checkpoint: the mixture begins here
            self.phase_start, self.base = self.position, [0] * len(self.parts)
            self.note = f"data: the mixture begins at sample {self.position} (the checkpoint read one source)"
            return
        check_resumed_mix(state, self.labels)  # another order would carry each source's count over to another
        old = [Fraction(w) for w in phase["weights"]]
        self.phase_start, self.base = int(phase["start"]), [int(n) for n in phase["consumed_at_start"]]
        if old != self.fractions:  # new weights: a new phase from here, each source's count carried on
            done = Schedule.build(old, self.seed).consumed(self.position - self.phase_start)
            self.phase_start, self.base = self.position, (np.asarray(self.base) + done).tolist()
            moved = ", ".join(
                f"{lbl} {float(a):.3g}->{float(b):.3g}" for lbl, a, b in zip(self.labels, old, self.fractions)
            )
            self.note = f"data: new mixture phase at sample {self.position} (shares {moved}; counts carried on)"


@dataclass(frozen=True)
class Mixture:
    labels: list[str]
    fractions: list[Fraction]
    splits: list[Splits]


def load_mixture(cfg: DataConfig) -> Mixture:
    sources = mixture_sources(cfg)
    return Mixture([s.label for s in sources], shares(sources), [load_splits(s.cfg) for s in sources])


def mix_loader(mixture: Mixture, split: str, seq_len: int, batch: int, seed: int, **coords: int) -> MixLoader:
    """A loader of `split` (train | val) of every source."""
    parts = [getattr(s, split) for s in mixture.splits]
    empty = np.zeros(0, dtype=np.uint8)
    return MixLoader(
        empty, seq_len, batch, seed=seed, parts=parts, fractions=mixture.fractions, labels=mixture.labels, **coords
    )


def vocabulary(cfg: DataConfig) -> str | None:
    """What a source's token ids mean, where it is known: bytes, or a tokenizer (a token file: unknown)."""
    if cfg.name == "stdlib":
        return "bytes (data=stdlib)"
    if cfg.name == "text" and cfg.tokenizer:
        return f"tokenizer {Path(cfg.tokenizer).expanduser().resolve()}"
    return None


def check_mix(cfg: DataConfig, vocab_size: int, seq_len: int, evaluates: bool) -> None:
    """Before any worker starts: every source readable, long enough for one sequence and within the
    model's vocabulary (check_source's lines, naming the source), and one vocabulary for them all."""
    sources: list[Source] = mixture_sources(cfg)
    period(sources)
    known = [(s, vocabulary(s.cfg)) for s in sources if vocabulary(s.cfg)]
    if len({v for _, v in known}) > 1:
        (a, va), (b, vb) = known[0], next((s, v) for s, v in known if v != known[0][1])
        raise LauncherError(
            f"{a.key} ({a.label}) and {b.key} ({b.label}) use different vocabularies ({va}; {vb}): "
            "mix sources of one tokenizer"
        )
    for s in sources:
        try:
            check_source(s.cfg, vocab_size, seq_len, evaluates)
        except LauncherError as err:
            raise LauncherError(f"{s.key} ({s.label}): {err}") from None
