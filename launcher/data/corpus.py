"""Token sources: the embedded byte-level corpus (Python's standard library) and flat token files.

Both end as memory-mapped 1-D numpy arrays of token ids, split into train and validation.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.config.schema import DataConfig
from launcher.data.build import TextCache
from launcher.data.loader import min_tokens
from launcher.errors import LauncherError
from launcher.files import make_dir, write_atomic


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
    make_dir(out.parent, "data.cache_dir")
    write_atomic(out, b"".join(chunks)[:max_bytes])


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
    size, itemsize = p.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise LauncherError(f"{key}={path}: the file is empty; give a flat {dtype} token file")
    if size % itemsize:
        raise LauncherError(
            f"{key}={path}: {size} bytes is not a multiple of {itemsize} ({dtype}): "
            f"a truncated file, or set data.dtype to the file's"
        )
    try:
        return np.memmap(p, dtype=np.dtype(dtype), mode="r")
    except OSError as err:
        raise LauncherError(f"{key}={path}: cannot read it ({err.strerror})") from None


def load_splits(cfg: DataConfig, text: TextCache | None = None) -> Splits:
    """The configured source's tokens, split; `text`: the data=text cache when the caller has it."""
    if cfg.name == "text":  # the held-out split is whole documents (data.val_path is refused)
        from launcher.data.text import ensure_cache, open_splits

        cache = text or ensure_cache(cfg)
        return Splits(*open_splits(cache, cfg.val_fraction), cache.vocab_size)
    if cfg.name == "stdlib":
        cache = stdlib_cache_path(cfg)
        if not cache.exists():
            build_stdlib_tokens(cfg.max_bytes, cache)
        tokens = np.memmap(cache, dtype=np.uint8, mode="r")
        vocab = 256
    elif cfg.name == "tokens":
        if not cfg.path:
            raise LauncherError("data.path is missing: data=tokens needs data.path=FILE (a flat token file)")
        tokens = open_tokens(cfg.path, cfg.dtype, "data.path")
        vocab = 0  # checked lazily against the model: scanning a large file here would be slow
    else:
        raise LauncherError(f"data.name={cfg.name}: use data=stdlib, data=tokens or data=text")
    if cfg.val_path:
        return Splits(tokens, open_tokens(cfg.val_path, cfg.dtype, "data.val_path"), vocab)
    n_val = max(int(tokens.size * cfg.val_fraction), 1)
    return Splits(tokens[: tokens.size - n_val], tokens[tokens.size - n_val :], vocab)


SCANNED = 100_000_000  # tokens checked against the vocabulary before the run (about 0.1 s)


def check_vocab(parts: list[np.ndarray], vocab_size: int, key: str, path: str) -> None:
    """The largest token id of one file (its splits, `parts`) fits the model's vocabulary."""
    top = max(int(tokens[:SCANNED].max()) for tokens in parts)
    if top >= vocab_size:
        fits = -(-(top + 1) // 64) * 64  # a multiple of 64, as GPT-2's 50257 ids train in 50304
        raise LauncherError(
            f"{key}={path} holds token id {top}, beyond model.vocab_size={vocab_size}: "
            f"set model.vocab_size={fits} (or more), or use the file's tokenizer"
        )


def check_source(cfg: DataConfig, vocab_size: int, seq_len: int, evaluates: bool) -> None:
    """Fail before any worker starts when the configured data cannot be read, is too short for one
    sequence (the validation split only matters when the run `evaluates`), or does not fit the model.
    data=text builds its token cache here, once, before any worker starts."""
    text = None
    if cfg.name == "text":
        from launcher.config.extras import require
        from launcher.data.text import ensure_cache

        require("datasets", "tokenizers", what="data=text")

        text = ensure_cache(cfg, vocab_size, announce=True)
    splits = load_splits(cfg, text)
    train = ("data.path", cfg.path) if cfg.name in ("tokens", "text") else ("data.max_bytes", cfg.max_bytes)
    val = ("data.val_path", cfg.val_path) if cfg.val_path else train
    need = min_tokens(seq_len)
    for split, (key, value), what in ((splits.train, train, "training"), (splits.val, val, "validation")):
        if split.size < need and (what == "training" or evaluates):
            held_out = "" if cfg.val_path else f" with data.val_fraction={cfg.val_fraction}"
            raise LauncherError(
                f"{key}={value}: {split.size} {what} tokens{held_out}, fewer than the {need} one sequence of "
                f"seq_len={seq_len} needs: use more data or a lower seq_len"
                + ("" if what == "training" else ", or set eval.every=0")
            )
    if cfg.name == "tokens":  # stdlib bytes fit any vocabulary that validate accepts
        check_vocab([splits.train] + ([] if cfg.val_path else [splits.val]), vocab_size, *train)
    if cfg.val_path:
        check_vocab([splits.val], vocab_size, *val)
