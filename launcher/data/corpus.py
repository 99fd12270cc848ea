"""Token sources: the embedded byte-level corpus (Python's standard library) and flat token files.

Both end as memory-mapped 1-D numpy arrays of token ids, split into train and validation.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.config import DataConfig, LauncherError


@dataclass(frozen=True)
class Splits:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int  # smallest vocabulary the tokens need


def stdlib_files() -> list[Path]:
    """The standard library's .py sources, in a deterministic order (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_stdlib_tokens(max_bytes: int, out: Path) -> None:
    """Concatenate source files (byte-level tokens) up to `max_bytes`; write atomically."""
    chunks, total = [], 0
    for path in stdlib_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\n")
        total += len(data) + 1
        if total >= max_bytes:
            break
    if not chunks:
        raise LauncherError("data=stdlib found no Python sources: use data=tokens data.path=FILE")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(b"".join(chunks)[:max_bytes])
    tmp.replace(out)


def stdlib_cache_path(cfg: DataConfig) -> Path:
    root = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha1(f"{root}|{cfg.max_bytes}|v1".encode()).hexdigest()[:12]
    return Path(cfg.cache_dir).expanduser() / f"stdlib-{key}.u8"


def open_tokens(path: str, dtype: str, key: str) -> np.ndarray:
    p = Path(path).expanduser()
    if not p.is_file():
        raise LauncherError(f"{key}={path}: no such file; give the path of a flat {dtype} token file")
    if dtype not in ("uint16", "uint32"):
        raise LauncherError(f"data.dtype={dtype}: use uint16 or uint32")
    arr = np.memmap(p, dtype=np.dtype(dtype), mode="r")
    if arr.size < 2:
        raise LauncherError(f"{key}={path}: the file holds fewer than 2 tokens")
    return arr


def load_splits(cfg: DataConfig) -> Splits:
    if cfg.name == "stdlib":
        cache = stdlib_cache_path(cfg)
        if not cache.exists():
            build_stdlib_tokens(cfg.max_bytes, cache)
        tokens = np.memmap(cache, dtype=np.uint8, mode="r")
        vocab = 256
    elif cfg.name == "tokens":
        check_source(cfg)
        tokens = open_tokens(str(cfg.path), cfg.dtype, "data.path")
        vocab = 0  # checked lazily against the model: scanning a large file here would be slow
    else:
        raise LauncherError(f"data.name={cfg.name}: use data=stdlib or data=tokens")
    if cfg.val_path:
        return Splits(tokens, open_tokens(cfg.val_path, cfg.dtype, "data.val_path"), vocab)
    n_val = max(int(tokens.size * cfg.val_fraction), 1)
    return Splits(tokens[: tokens.size - n_val], tokens[tokens.size - n_val :], vocab)


SCANNED = 100_000_000  # tokens checked against the vocabulary before the run (about 0.1 s)


def check_vocab(tokens: np.ndarray, vocab_size: int, key: str, path: str) -> None:
    top = int(tokens[:SCANNED].max())
    if top >= vocab_size:
        raise LauncherError(
            f"{key}={path} holds token id {top}, beyond model.vocab_size={vocab_size}: "
            f"use a model with a larger vocabulary or the file's tokenizer"
        )


def check_source(cfg: DataConfig, vocab_size: int | None = None) -> None:
    """Fail before any worker starts when the configured data cannot be read or does not fit the model."""
    if cfg.name == "tokens":
        if not cfg.path:
            raise LauncherError("data.path is missing: data=tokens needs data.path=FILE (a flat token file)")
        tokens = open_tokens(cfg.path, cfg.dtype, "data.path")
        if vocab_size is not None:
            check_vocab(tokens, vocab_size, "data.path", cfg.path)
    if cfg.val_path:
        val = open_tokens(cfg.val_path, cfg.dtype, "data.val_path")
        if vocab_size is not None:
            check_vocab(val, vocab_size, "data.val_path", cfg.val_path)
