"""Where documents end in a source's token stream, for document masking (launcher/model/documents.py).

data=text writes each document as [BOS] tokens EOS (launcher/data/build.py): its tokenizer's EOS ends
a document. A data=tokens file names its end id in `data.eos_id`. data=stdlib joins source files
with a newline, no separator a mask could find: refused (launcher/validate.py).
"""

from __future__ import annotations

import numpy as np

from launcher.config import DataConfig
from launcher.flops import document_span

SAMPLED = 10_000_000  # tokens of the split whose documents set the measured span (a few ms)


def end_of_document(cfg: DataConfig) -> int | None:
    """The id ending each document of the source."""
    if cfg.name == "text":
        from launcher.data import tokenizer

        return tokenizer.load(cfg.tokenizer).eos_id
    return cfg.eos_id


def measured_span(tokens: np.ndarray, eos: int, seq_len: int) -> float:
    """Keys per query (before the causal half) that a document-masked sequence of `seq_len` attends
    over, from the documents of the split's first `SAMPLED` tokens (flops.document_span)."""
    head = np.asarray(tokens[:SAMPLED])
    ends = np.flatnonzero(head == eos) + 1
    lengths = np.diff(ends, prepend=0) if ends.size else np.array([head.size])
    return document_span(lengths.tolist(), seq_len)
