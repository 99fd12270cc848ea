"""A text corpus and a BPE tokenizer made on the spot from Python's standard library (no download):
for tests/integration/test_text.py, tests/unit/test_docs.py and bench/tokenize.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from launcher.data.corpus import stdlib_files


def stdlib_texts(max_chars: int, skip: int = 0) -> list[str]:
    """Standard-library sources as documents (one per file), up to `max_chars` characters in all."""
    texts, total = [], 0
    for path in stdlib_files()[skip:]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def train_bpe(out: Path, vocab_size: int = 512, max_chars: int = 400_000) -> Path:
    """A byte-level BPE tokenizer.json trained with `tokenizers` on stdlib sources; EOS <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_texts(max_chars), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def write_corpus(folder: Path, max_chars: int = 300_000, kinds: tuple[str, ...] = ("jsonl", "txt", "parquet")) -> None:
    """Stdlib sources split over files of each kind: `part-K.jsonl` (field `text`), `doc-K.txt` (one
    document each), `part-K.parquet`; two jsonl files so a glob matters."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = stdlib_texts(max_chars, skip=50)
    groups = [texts[i :: len(kinds) + 1] for i in range(len(kinds) + 1)]
    for i, kind in enumerate((*kinds, kinds[0])):
        docs = groups[i]
        if kind == "jsonl":
            with (folder / f"part-{i}.jsonl").open("w") as f:
                f.writelines(json.dumps({"text": t, "id": n}) + "\n" for n, t in enumerate(docs))
        elif kind == "txt":
            for n, t in enumerate(docs[:5]):
                (folder / f"doc-{i}-{n}.txt").write_text(t)
        else:
            pq.write_table(pa.table({"text": docs}), folder / f"part-{i}.parquet")
