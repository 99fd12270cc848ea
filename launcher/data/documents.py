"""Where documents end in a source's token stream, for document masking (launcher/model/documents.py).

data=text writes each document as [BOS] tokens EOS (launcher/data/build.py): its tokenizer's EOS ends
a document. A data=tokens file names its end id in `data.eos_id`. A mixture's sources must share one.
data=stdlib joins source files with a newline, no separator a mask could find: refused (launcher/config/validate.py).
"""

from __future__ import annotations

import numpy as np

from launcher.config.mix import mixture_sources
from launcher.config.schema import DataConfig
from launcher.data.corpus import Splits
from launcher.data.mix import Mixture
from launcher.errors import LauncherError
from launcher.flops import document_span

SAMPLED = 10_000_000  # tokens of the split whose documents set the measured span (a few ms)


def end_of_document(cfg: DataConfig) -> int | None:
    """The id ending each document of the source; of a mixture, the one id all its sources share."""
    if cfg.name == "mix":
        sources = mixture_sources(cfg)
        ends = {s.label: end_of_document(s.cfg) for s in sources}
        if len(set(ends.values())) > 1:
            raise LauncherError(
                f"data.document_mask=true: the sources end documents with different ids "
                f"({', '.join(f'{label} {eos}' for label, eos in ends.items())}): one mask needs one end id: "
                "give them one tokenizer, or set the tokens sources' eos_id to the same id"
            )
        return next(iter(ends.values()))
    if cfg.name == "text":
        from launcher.data import tokenizer

        return tokenizer.load(cfg.tokenizer).eos_id
    return cfg.eos_id


def data_span(data: Splits | Mixture, eos: int, seq_len: int) -> float:
    """The measured span of the training split; of a mixture, its sources' weighted by their shares
    (each sequence comes from one source)."""
    if isinstance(data, Mixture):
        return float(sum(f * measured_span(s.train, eos, seq_len) for f, s in zip(data.fractions, data.splits)))
    return measured_span(data.train, eos, seq_len)


def measured_span(tokens: np.ndarray, eos: int, seq_len: int) -> float:
    """Keys per query (before the causal half) that a document-masked sequence of `seq_len` attends
    over, from the documents of the split's first `SAMPLED` tokens (flops.document_span)."""
    head = np.asarray(tokens[:SAMPLED])
    ends = np.flatnonzero(head == eos) + 1
    lengths = np.diff(ends, prepend=0) if ends.size else np.array([head.size])
    return document_span(lengths.tolist(), seq_len)
