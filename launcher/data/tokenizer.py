"""A Hugging Face tokenizer for data=text: a `tokenizer.json` or a local model folder.

`tokenizers` reads every fast tokenizer (the `tokenizer.json` file that model folders ship); a folder
without one falls back to `transformers.AutoTokenizer` when it is installed. Either way the corpus
builder sees one small interface: encode a batch of texts without special tokens, and the ids of
the end-of-text token (which separates documents) and of the begin-of-text token where there is one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import LauncherError

# special tokens looked up by name when no tokenizer_config.json says which they are
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|bos|>", "[BOS]")
# files of a model folder that define its tokenizer (the cache key hashes them, not the weights)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
TOKENIZER_GLOBS = ("vocab.*", "merges.txt", "*.model", "*.tiktoken")


@dataclass(frozen=True)
class Tokenizer:
    """What the corpus builder needs; `path` is what a worker process loads again (`load`)."""

    path: str
    backend: Any  # tokenizers.Tokenizer, or a transformers tokenizer
    vocab_size: int
    eos_id: int
    bos_id: int | None  # None: the tokenizer has none, or it is the EOS token itself (GPT-2)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if hasattr(self.backend, "encode_batch"):
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self.backend(texts, add_special_tokens=False)["input_ids"]


def source_files(path: str) -> list[Path]:
    """The files that define the tokenizer at `path` (a tokenizer.json, or a folder's tokenizer files)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p, *[f for f in [p.parent / "tokenizer_config.json"] if f.is_file() and f != p]]
    found = {p / name for name in TOKENIZER_FILES if (p / name).is_file()}
    found |= {f for pattern in TOKENIZER_GLOBS for f in p.glob(pattern) if f.is_file()}
    return sorted(found)


def load(path: str) -> Tokenizer:
    """The tokenizer at `path`, or a LauncherError naming data.tokenizer and what is wrong."""
    p = Path(path).expanduser()
    key = f"data.tokenizer={path}"
    if not p.exists():
        raise LauncherError(f"{key}: no such file or folder; give a tokenizer.json or a local model folder")
    file = p / "tokenizer.json" if p.is_dir() else p
    if file.is_file():
        from tokenizers import Tokenizer as HFTokenizer

        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception on any parse error
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise LauncherError(
                f"{key}: cannot read {file.name} ({reason}): give a Hugging Face tokenizer.json"
            ) from None
        vocab = backend.get_vocab_size(with_added_tokens=True)
        token_id = backend.token_to_id
    else:
        backend = auto_tokenizer(p, key)
        vocab = len(backend)
        token_id = backend.get_vocab().get  # convert_tokens_to_ids would map an unknown name to <unk>
    eos_name, bos_name = special_names(file.parent if file.is_file() else p)
    eos = lookup(token_id, eos_name, EOS_NAMES)
    if eos is None:
        raise LauncherError(
            f"{key}: the tokenizer has no end-of-text token (none of {', '.join(EOS_NAMES)}) to separate "
            f"documents: name it as eos_token in a tokenizer_config.json beside it"
        )
    bos = lookup(token_id, bos_name, BOS_NAMES)
    return Tokenizer(str(p), backend, vocab, eos, None if bos == eos else bos)


def auto_tokenizer(folder: Path, key: str) -> Any:
    """A folder without tokenizer.json (a slow, sentencepiece-only tokenizer): transformers reads it."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise LauncherError(
            f"{key}: the folder has no tokenizer.json; install transformers (pip install -e '.[hf]') to read it"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        reason = str(err).splitlines()[0]
        raise LauncherError(f"{key}: cannot load a tokenizer from the folder ({reason})") from None


def special_names(folder: Path) -> tuple[str | None, str | None]:
    """(eos_token, bos_token) as the folder's tokenizer_config.json names them, if it does."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None, None

    def name(entry: Any) -> str | None:
        return entry.get("content") if isinstance(entry, dict) else entry

    return name(config.get("eos_token")), name(config.get("bos_token"))


def lookup(token_id: Any, named: str | None, candidates: tuple[str, ...]) -> int | None:
    """The id of the configured special token, else of the first well-known name the vocabulary has."""
    for name in _names(named, candidates):
        found = token_id(name)
        if found is not None and found >= 0:
            return int(found)
    return None


def _names(named: str | None, candidates: tuple[str, ...]) -> Iterator[str]:
    if named:
        yield named
    yield from candidates
