"""Issue 13 figure: tokenizing throughput of data=text (tokens/s) with data.workers=1 and 2.

A corpus of standard-library sources as .jsonl files and a byte-level BPE tokenizer trained on them
(no download), both made here. Each round builds the cache from scratch end to end (read with
`datasets`, tokenize, write) once per worker count, alternating, so machine noise hits both alike;
the figures are the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launcher.config.schema import compose_config
from launcher.data.text import ensure_cache
from tests.textdata import stdlib_texts, train_bpe

WORKERS = (1, 2)


def write_jsonl(folder: Path, max_chars: int, files: int = 4) -> int:
    """Stdlib sources as `files` .jsonl files; returns the number of characters."""
    folder.mkdir(parents=True)
    texts = stdlib_texts(max_chars)
    for i in range(files):
        with (folder / f"part-{i}.jsonl").open("w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts[i::files])
    return sum(map(len, texts))


def build_once(tmp: Path, workers: int, run: int) -> tuple[int, float]:
    """(tokens, seconds) of one cache build from scratch."""
    cfg = compose_config(
        "data=text",
        f"data.path={tmp / 'corpus' / '*.jsonl'}",
        f"data.tokenizer={tmp / 'tokenizer.json'}",
        f"data.workers={workers}",
        f"data.cache_dir={tmp / f'cache-{workers}-{run}'}",
        "model.vocab_size=8192",
    )
    t0 = time.perf_counter()
    cache = ensure_cache(cfg.data)
    seconds = time.perf_counter() - t0
    return cache.tokens.stat().st_size // cache.dtype.itemsize, seconds


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench tokenize")
    parser.add_argument("--rounds", type=int, default=3, help="alternating workers=1/2 rounds")
    parser.add_argument("--chars", type=int, default=8_000_000, help="corpus size in characters")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        chars = write_jsonl(tmp / "corpus", args.chars)
        train_bpe(tmp / "tokenizer.json", vocab_size=8192, max_chars=2_000_000)
        rates: dict[int, list[float]] = {w: [] for w in WORKERS}
        for run in range(args.rounds):
            for workers in WORKERS:
                tokens, seconds = build_once(tmp, workers, run)
                rates[workers].append(tokens / seconds)
    table = Table(title=f"data=text tokenizing: {chars / 1e6:.1f}M characters of jsonl, BPE 8192, {tokens:,} tokens")
    for col in ("data.workers", "median tokens/s", "all rounds (tokens/s)", "vs 1 worker"):
        table.add_column(col, justify="right")
    base = statistics.median(rates[1])
    for workers in WORKERS:
        median = statistics.median(rates[workers])
        table.add_row(
            str(workers), f"{median:,.0f}", ", ".join(f"{r:,.0f}" for r in rates[workers]), f"{median / base:.2f}x"
        )
    Console().print(table)
