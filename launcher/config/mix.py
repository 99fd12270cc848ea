"""`data=mix`: the sources of a weighted mixture, read and checked from `data.sources` (docs/data.md).

Pure Python (no numpy, no torch): `plan` and `validate` check a mixture as `train` does. Each source is
a dict of DataConfig keys (name stdlib | tokens | text, path, tokenizer, ...) plus `weight` and an
optional `label`; the keys it leaves unset are the `data` section's own (cache_dir, tokenizer, ...).
Weights are exact decimals: the schedule (launcher/data/mix.py) repeats every `period` sequences, the
common denominator of the normalized weights.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce
from typing import Any

from launcher.config.schema import DataConfig
from launcher.errors import LauncherError

MIX_KEYS = ("weight", "label")
SOURCE_NAMES = ("stdlib", "tokens", "text")
MAX_PERIOD = 1 << 18  # sequences per schedule period: the table each rank holds (a few MB at most)
_LABEL = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class Source:
    """One source of a mixture: its label (metric names), its own data config, its exact weight."""

    index: int
    label: str
    cfg: DataConfig
    weight: Fraction

    @property
    def key(self) -> str:
        return f"data.sources[{self.index}]"


def _weight(key: str, value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise LauncherError(f"{key}.weight={value}: give a number > 0 (relative: weights 3 and 1 give 75% and 25%)")
    return Fraction(str(value))  # the decimal as written: 0.1 is 1/10, not the float nearest it


def _source(cfg: DataConfig, index: int, raw: object) -> Source:
    key = f"data.sources[{index}]"
    if not isinstance(raw, dict):
        raise LauncherError(f"{key}={raw}: give each source as a mapping, e.g. {{name: stdlib, weight: 1}}")
    allowed = {f.name for f in dataclasses.fields(DataConfig)} - {"sources"} | set(MIX_KEYS)
    if unknown := sorted(set(raw) - allowed):
        raise LauncherError(f"{key}: unknown key {', '.join(unknown)}: use {', '.join(sorted(allowed))}")
    name = raw.get("name")
    if name == "mix":
        raise LauncherError(f"{key}.name=mix: a mixture cannot nest; list its sources in data.sources directly")
    if name not in SOURCE_NAMES:
        raise LauncherError(f"{key}.name={name}: give each source a name, one of {', '.join(SOURCE_NAMES)}")
    weight = _weight(key, raw.get("weight"))
    label = str(raw.get("label", name))
    if not _LABEL.match(label):
        raise LauncherError(f"{key}.label={label}: use letters, digits, _ and - (it names the source's metrics)")
    own = {k: v for k, v in raw.items() if k not in MIX_KEYS}
    return Source(index, label, dataclasses.replace(cfg, sources=[], **own), weight)


def mixture_sources(cfg: DataConfig) -> list[Source]:
    """The sources of `data=mix`, checked: one LauncherError naming the source and the fix."""
    if not cfg.sources:
        raise LauncherError(
            "data=mix has no data.sources: give a list, e.g. data.sources='[{name: stdlib, weight: 3}, "
            "{name: tokens, path: code.bin, weight: 1}]'"
        )
    sources = [_source(cfg, i, raw) for i, raw in enumerate(cfg.sources)]
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):  # the default label is the name: number the repeats
        counts = {label: labels.count(label) for label in labels}
        sources = [dataclasses.replace(s, label=f"{s.label}{s.index}") if counts[s.label] > 1 else s for s in sources]
        if len({s.label for s in sources}) < len(sources):
            raise LauncherError(f"data.sources: labels {labels} repeat: give each source its own label")
    period(sources)
    return sources


def shares(sources: list[Source]) -> list[Fraction]:
    """Each source's exact share of the sequences: its weight over the sum."""
    total = sum(s.weight for s in sources)
    return [s.weight / total for s in sources]


def period(sources: list[Source]) -> int:
    """Sequences after which the schedule repeats: the common denominator of the shares."""
    p = reduce(math.lcm, (share.denominator for share in shares(sources)), 1)
    if p > MAX_PERIOD:
        weights = ", ".join(f"{s.label}={float(s.weight):g}" for s in sources)
        raise LauncherError(
            f"data.sources weights {weights} repeat only every {p} sequences (at most {MAX_PERIOD}): "
            f"give weights with fewer digits, e.g. 3, 2, 1 or 0.5, 0.3, 0.2"
        )
    return p


def check_resumed_mix(state: dict[str, Any], labels: list[str] | None) -> None:
    """A checkpoint's data position (`state`, the loader's) resumed by this run's data: a mixture's only by
    the same sources in their order (`labels`; None: a single source), else each source's count would
    go to another, or be lost. One line; the checkpoints stay as they are."""
    phase = state.get("mix")
    if phase is None:  # a single source's position: a mixture may begin there
        return
    if labels is None:
        raise LauncherError(
            f"the checkpoint was written by data=mix (sources {', '.join(phase['labels'])}): resume it "
            "with data=mix and the same data.sources, or start over in a new run_dir"
        )
    if phase["labels"] != labels:
        raise LauncherError(
            f"data.sources: the checkpoint mixes {phase['labels']} in this order, this run {labels}: "
            "keep the sources and their order (their weights may change), or start over in a new run_dir"
        )
