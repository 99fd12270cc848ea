"""Text corpora (data=text): local .txt/.jsonl/.parquet files, tokenized once into a cached token file.

A .txt file is one document; a .jsonl or .parquet row is one, its `data.text_key` field. The cache
under data.cache_dir holds the documents' tokens back to back, each as [BOS] tokens EOS, in one flat
memory-mapped file, beside their start offsets (so the validation split is whole documents). Its name
hashes the files' contents, the text key and the tokenizer's files: a changed corpus or tokenizer
builds a new cache, anything else (a path, a timestamp, a copy) reuses it. The launcher builds it
before any worker starts (`ensure_cache`, from data.corpus.check_source), so workers only open it.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from launcher.config.schema import DataConfig
from launcher.data import tokenizer as tok
from launcher.data.build import BUILDERS, TextCache, build_cache, check_text_key
from launcher.errors import LauncherError
from launcher.files import make_dir, write_atomic

CACHE_VERSION = "text-v1"  # bump when the cache layout changes
MEMO = "file-digests.json"  # content hashes of corpus files by (path, size, mtime), beside the caches


def corpus_files(pattern: str | None) -> list[Path]:
    """The files `data.path` names: paths or globs, comma-separated, each matching at least one file."""
    if not pattern:
        raise LauncherError("data.path is missing: data=text needs data.path='corpus/*.jsonl' (files or globs)")
    files: set[Path] = set()
    for part in (p.strip() for p in pattern.split(",") if p.strip()):
        matched = [Path(m) for m in glob.glob(str(Path(part).expanduser()), recursive=True) if Path(m).is_file()]
        if not matched:
            raise LauncherError(f"data.path={part} matches no file: give existing .txt, .jsonl or .parquet files")
        files.update(matched)
    for f in files:
        if f.suffix not in BUILDERS:
            raise LauncherError(f"data.path: {f} is not .txt, .jsonl (.json) or .parquet: convert it, or leave it out")
    return sorted(files)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as err:
        raise LauncherError(f"data.path: cannot read {path} ({err.strerror})") from None
    return h.hexdigest()


def cache_for(cfg: DataConfig, files: list[Path], tokenizer: tok.Tokenizer) -> TextCache:
    """Where the cache of these files and this tokenizer lives: the name is a hash of their contents."""
    root = Path(cfg.cache_dir).expanduser()
    h = hashlib.sha256(f"{CACHE_VERSION}|{cfg.text_key}|{tokenizer.eos_id}|{tokenizer.bos_id}".encode())
    # contents (and kind: a .txt is one document), not names: a copied corpus hits the cache
    for f, digest in zip(files, digests(files, root)):
        h.update(f"|{BUILDERS[f.suffix]}:{digest}".encode())
    for f in tok.source_files(tokenizer.path):
        h.update(f"|tok:{f.name}:{file_digest(f)}".encode())
    base = root / f"text-{h.hexdigest()[:16]}"
    return TextCache(base.with_suffix(".tokens"), base.with_suffix(".docs.npy"), tokenizer.vocab_size)


def digests(files: list[Path], cache_dir: Path) -> list[str]:
    """The files' content hashes, remembered in cache_dir by (path, size, mtime) as make and git do, so
    that each worker and each later run does not read the whole corpus again; an edited file's size or
    mtime changes, and it is hashed anew."""
    memo_file = cache_dir / MEMO
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    found, fresh = [], {}
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        digest = memo.get(key) or fresh.get(key) or file_digest(f)
        if key not in memo:
            fresh[key] = digest
        found.append(digest)
    if fresh:  # a lost race between two writers only costs a later run one more hash
        make_dir(cache_dir, "data.cache_dir")
        write_atomic(memo_file, json.dumps(memo | fresh))
    return found


def check_vocab_fits(cfg: DataConfig, tokenizer: tok.Tokenizer, vocab_size: int) -> None:
    if vocab_size < tokenizer.vocab_size:
        raise LauncherError(
            f"model.vocab_size={vocab_size} is smaller than the {tokenizer.vocab_size} tokens of "
            f"data.tokenizer={cfg.tokenizer}: set model.vocab_size={tokenizer.vocab_size} (or larger)"
        )


def resolve(cfg: DataConfig) -> tuple[list[Path], tok.Tokenizer]:
    if not cfg.tokenizer:
        raise LauncherError("data.tokenizer is missing: data=text needs data.tokenizer=PATH (tokenizer.json or folder)")
    return corpus_files(cfg.path), tok.load(cfg.tokenizer)


def ensure_cache(cfg: DataConfig, vocab_size: int | None = None, announce: bool = False) -> TextCache:
    """The cache of the configured corpus, built unless it exists. The launcher calls it before any
    worker starts (checking the files, the tokenizer and `vocab_size` too), so workers only open it."""
    files, tokenizer = resolve(cfg)
    if vocab_size is not None:
        check_vocab_fits(cfg, tokenizer, vocab_size)
    cache = cache_for(cfg, files, tokenizer)
    if not cache.tokens.exists():
        check_text_key(files, cfg.text_key)
        with build_lock(cache):  # processes that start together (torchrun ranks, runs sharing a cache) build it once
            if not cache.tokens.exists():
                build_cache(files, cfg.text_key, tokenizer, cfg.workers, cache)
                return cache
    if announce:
        print(f"data=text: reusing the cached tokens {cache.tokens}", flush=True)
    return cache


@contextmanager
def build_lock(cache: TextCache) -> Iterator[None]:
    """An exclusive lock beside the cache, held while one process builds it (the rename alone keeps a
    reader from half a file; the lock keeps a second process from tokenizing the corpus again)."""
    make_dir(cache.tokens.parent, "data.cache_dir")
    with cache.tokens.with_suffix(".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def open_splits(cache: TextCache, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) tokens of a built cache: the last `val_fraction` of the documents (at least
    one) are held out whole."""
    tokens, starts = np.memmap(cache.tokens, dtype=cache.dtype, mode="r"), np.load(cache.docs)
    n_docs = starts.size - 1
    n_val = min(max(round(n_docs * val_fraction), 1), n_docs)
    cut = int(starts[n_docs - n_val])
    return tokens[:cut], tokens[cut:]
