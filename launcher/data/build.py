"""Building a text corpus's token cache (launcher/data/text.py): read with `datasets`, tokenized in
`workers` threads, written once to temporary files that are then renamed into place.

The documents stream through in chunks, in file order, and their tokens are written in the same
order, so the cache is identical whatever the number of workers.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from launcher.data import tokenizer as tok
from launcher.errors import LauncherError
from launcher.files import make_dir, temp_beside

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets' loaders


@dataclass(frozen=True)
class TextCache:
    tokens: Path  # flat token ids (uint16 or uint32 by vocabulary), written last: its presence means complete
    docs: Path  # int64 start offset of every document, then the total
    vocab_size: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


READ_ROWS = 64  # rows per read from a file
CHUNK_CHARS = 1 << 16  # characters per encoding task: large enough to amortize a call, small enough to balance


def read_file(path: Path) -> Any:
    """The file's rows as a streaming `datasets` IterableDataset: read in place, no arrow copy, no network."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    options = {"sample_by": "document"} if BUILDERS[path.suffix] == "text" else {}
    return datasets.load_dataset(
        BUILDERS[path.suffix], data_files=[str(path)], split="train", streaming=True, **options
    )


def column(path: Path, text_key: str) -> str:
    return "text" if BUILDERS[path.suffix] == "text" else text_key


def unreadable(path: Path, err: Exception) -> LauncherError:
    reason = (str(err).splitlines() or [type(err).__name__])[0]
    return LauncherError(f"data.path: cannot read {path} ({reason}): fix or remove the file")


def check_text_key(files: list[Path], text_key: str) -> None:
    """Every .jsonl/.parquet file has the text field (its first row or its schema says)."""
    for path in files:
        if BUILDERS[path.suffix] == "text":
            continue
        try:
            rows = read_file(path)
            names = rows.column_names or list(next(iter(rows), {}))
        except Exception as err:  # datasets and pyarrow raise many kinds on a malformed file
            raise unreadable(path, err) from None
        if text_key not in names:
            raise LauncherError(
                f"data.text_key={text_key}: {path} has no '{text_key}' field (it has {', '.join(names) or 'none'}): "
                f"set data.text_key to the field that holds the text"
            )


def documents(files: list[Path], text_key: str) -> Iterator[list[str]]:
    """The corpus's non-empty documents in file order, in chunks of about CHUNK_CHARS characters."""
    chunk: list[str] = []
    size = 0
    for path in files:
        key = column(path, text_key)
        try:
            for batch in read_file(path).select_columns([key]).iter(batch_size=READ_ROWS):
                for text in batch[key]:
                    if not text:
                        continue
                    if not isinstance(text, str):
                        raise LauncherError(f"data.text_key={text_key}: {path} has a '{key}' that is not text")
                    chunk.append(text)
                    size += len(text)
                    if size >= CHUNK_CHARS:
                        yield chunk
                        chunk, size = [], 0
        except LauncherError:
            raise
        except Exception as err:
            raise unreadable(path, err) from None
    if chunk:
        yield chunk


def encode(tokenizer: tok.Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths) of a chunk of documents, each as [BOS] tokens EOS."""
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    docs = [np.asarray(head + ids + [tokenizer.eos_id], dtype=np.int64) for ids in tokenizer.encode(texts)]
    return np.concatenate(docs), np.array([d.size for d in docs], dtype=np.int64)


@contextmanager
def single_threaded_tokenizers() -> Iterator[None]:
    """`tokenizers` would spread each batch over every core itself: off, so `data.workers` alone
    sets the parallelism (read by the library at each call)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encoded(
    chunks: Iterator[list[str]], tokenizer: tok.Tokenizer, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens, lengths, characters) per chunk, in order. Threads suffice: `tokenizers` releases the
    GIL while it encodes. A bounded window of chunks is in flight, so memory stays flat."""
    with single_threaded_tokenizers(), ThreadPoolExecutor(workers, thread_name_prefix="tokenize") as pool:
        pending: deque[tuple[Future, int]] = deque()
        for texts in chunks:
            pending.append((pool.submit(encode, tokenizer, texts), sum(map(len, texts))))
            while len(pending) > 2 * workers or (pending and pending[0][0].done()):
                result, chars = pending.popleft()
                yield (*result.result(), chars)
        for result, chars in pending:
            yield (*result.result(), chars)


def build_cache(
    files: list[Path], text_key: str, tokenizer: tok.Tokenizer, workers: int | None, cache: TextCache
) -> None:
    """Tokenize the corpus into `cache`, with a progress bar; temporary files renamed into place,
    the document offsets first and the tokens last (their presence marks a complete cache)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    workers = workers or os.cpu_count() or 1
    make_dir(cache.tokens.parent, "data.cache_dir")
    tmp_tokens, tmp_docs = temp_beside(cache.tokens), temp_beside(cache.docs)
    total_chars = sum(f.stat().st_size for f in files)
    columns = (
        TextColumn("tokenizing"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
    )
    t0, lengths, console = time.perf_counter(), [], Console(stderr=True)
    try:
        with Progress(
            *columns, TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal
        ) as bar:
            task = bar.add_task("tokenizing", total=total_chars, tokens=0)
            with tmp_tokens.open("wb") as out:
                for tokens, sizes, chars in encoded(documents(files, text_key), tokenizer, workers):
                    out.write(tokens.astype(cache.dtype).tobytes())
                    lengths.append(sizes)
                    bar.update(task, advance=chars, tokens=bar.tasks[0].fields["tokens"] + tokens.size)
        if not lengths:
            raise LauncherError(f"data.path: the {len(files)} files hold no text: check data.path and data.text_key")
        starts = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
        with tmp_docs.open("wb") as out:
            np.save(out, starts)
        tmp_docs.replace(cache.docs)
        tmp_tokens.replace(cache.tokens)
    finally:
        tmp_tokens.unlink(missing_ok=True)
        tmp_docs.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    print(
        f"data=text: tokenized {starts.size - 1:,} documents into {int(starts[-1]):,} tokens in {seconds:.1f} s "
        f"({starts[-1] / seconds:,.0f} tokens/s, {workers} workers) -> {cache.tokens}",
        flush=True,
    )
