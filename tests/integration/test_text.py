"""data=text: text files and a Hugging Face tokenizer, tokenized once into a cached token file.

The tokenizer is a small BPE trained here from the standard library (tests/textdata.py): no download.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from launcher.data import text, tokenizer
from launcher.data.build import TextCache, encode
from launcher.data.corpus import load_splits
from launcher.data.text import MEMO, corpus_files, ensure_cache
from launcher.files import write_atomic
from tests.conftest import assert_bad_input, losses, make_config, run_cli, tiny_args
from tests.textdata import train_bpe, write_corpus

VOCAB = 512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with tokenizer.json and corpus/ (.jsonl, .txt and .parquet files)."""
    root = tmp_path_factory.mktemp("text")
    train_bpe(root / "tokenizer.json", VOCAB)
    write_corpus(root / "corpus")
    return root


def text_args(root: Path, cache: Path, pattern: str = "corpus/*", *more: str) -> list[str]:
    return [
        *tiny_args(cache, steps=6),
        "data=text",
        f"data.path={root / pattern}",
        f"data.tokenizer={root / 'tokenizer.json'}",
        f"model.vocab_size={VOCAB}",
        *more,
    ]


@pytest.mark.slow
def test_cache_holds_whole_documents_and_is_the_same_for_any_worker_count(corpus: Path, tmp_path: Path) -> None:
    caches = []
    for workers in (1, 2):
        cfg = make_config(*text_args(corpus, tmp_path / f"cache{workers}", "corpus/*", f"data.workers={workers}"))
        cache = ensure_cache(cfg.data, VOCAB)
        caches.append(cache.tokens.read_bytes())
    assert caches[0] == caches[1] and len(caches[0]) > 100_000
    splits = load_splits(cfg.data)
    tokens, starts = np.memmap(cache.tokens, dtype=np.uint16, mode="r"), np.load(cache.docs)
    tok = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    assert (tokens[starts[1:] - 1] == eos).all() and (tokens == eos).sum() == starts.size - 1  # one EOS per document
    # the first document is the first file (sorted: a .txt, one document) and decodes back to its text
    first = corpus_files(str(corpus / "corpus/*"))[0]
    assert first.suffix == ".txt"
    text = first.read_text()
    assert tok.decode(tokens[starts[0] : starts[1] - 1].tolist()) == text
    # the validation split is whole documents: it starts where a document starts
    assert splits.train.size in set(starts.tolist()) and splits.train.size + splits.val.size == tokens.size
    assert splits.vocab_size == tok.get_vocab_size()


@pytest.mark.slow
def test_cache_is_keyed_by_content_and_built_once_by_concurrent_processes(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(corpus / "corpus", copy)
    cfg = make_config(*text_args(corpus, tmp_path / "cache"), f"data.path={copy}/*.jsonl", "data.workers=1")
    with ThreadPoolExecutor(2) as pool:  # two builders at once (each opens the lock on its own, as processes do)
        built = list(pool.map(lambda _: ensure_cache(cfg.data, VOCAB), range(2)))
    assert built[0] == built[1] and capsys.readouterr().out.count("data=text: tokenized") == 1
    hashed, real = [], text.file_digest
    monkeypatch.setattr(text, "file_digest", lambda path: hashed.append(path) or real(path))
    assert ensure_cache(cfg.data) == built[0]  # a worker opening it does not read the corpus again
    assert all(p.suffix != ".jsonl" for p in hashed), hashed
    with (copy / "part-0.jsonl").open("a") as f:  # an edit makes another cache
        f.write(json.dumps({"text": "one more document"}) + "\n")
    assert ensure_cache(cfg.data).tokens != built[0].tokens
    assert [p.name for p in hashed if p.suffix == ".jsonl"] == ["part-0.jsonl"]


def test_threads_of_one_process_write_one_file_atomically(tmp_path: Path) -> None:
    """Each writer renames its own temporary file (the pid alone is shared by threads: CI once lost the
    digest memo's rename to the other builder thread)."""
    target = tmp_path / MEMO

    def write(i: int) -> None:
        for _ in range(50):
            write_atomic(target, json.dumps({"writer": i}))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))  # re-raises a writer's error
    assert json.loads(target.read_text())["writer"] in range(4)
    assert [p.name for p in tmp_path.iterdir()] == [MEMO]  # no temporary file left behind


def test_bos_and_eos_come_from_the_model_folder(tmp_path: Path) -> None:
    """A folder's tokenizer_config.json names the special tokens: each document is BOS tokens EOS."""
    from tokenizers import models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["some text", "more text"], trainers.BpeTrainer(special_tokens=["<s>", "</s>"]))
    (tmp_path / "model").mkdir()
    backend.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "model" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    loaded = tokenizer.load(str(tmp_path / "model"))
    assert (loaded.bos_id, loaded.eos_id) == (backend.token_to_id("<s>"), backend.token_to_id("</s>"))
    tokens, lengths = encode(loaded, ["some text", "more"])
    ids = backend.encode("some text", add_special_tokens=False).ids
    assert tokens[: len(ids) + 2].tolist() == [loaded.bos_id, *ids, loaded.eos_id] and lengths[0] == len(ids) + 2


@pytest.mark.slow
def test_trains_from_a_fresh_cache_reuses_it_and_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = run_cli(
        "train", *text_args(corpus, cache, "corpus/*.jsonl", "checkpoint.every=3", "run_dir=full"), cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "data=text: tokenized" in first.stdout
    (built,) = cache.glob("text-*.tokens")
    stamp = built.stat().st_mtime_ns
    resume = f"resume={tmp_path / 'full/checkpoints/step_00000003'}"
    second = run_cli("train", *text_args(corpus, cache, "corpus/*.jsonl", resume, "run_dir=resumed"), cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "data=text: reusing the cached tokens" in second.stdout and "tokenized" not in second.stdout
    assert list(cache.glob("text-*.tokens")) == [built] and built.stat().st_mtime_ns == stamp
    expected = losses(tmp_path / "full")
    assert losses(tmp_path / "resumed") == {s: expected[s] for s in range(4, 7)}


@pytest.mark.slow
def test_two_data_parallel_ranks_match_one_process(corpus: Path, tmp_path: Path) -> None:
    """The text corpus goes through the same sharded loader: dp=2 sees the same global batches."""
    runs = {}
    for dp in (1, 2):
        args = text_args(
            corpus, tmp_path / "cache", "corpus/*", "steps=5", "batch.global=8", f"dp={dp}", f"run_dir=dp{dp}"
        )
        result = run_cli("train", *args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[dp] = losses(tmp_path / f"dp{dp}")
    assert runs[1].keys() == runs[2].keys() and len(runs[1]) == 5
    assert all(abs(runs[1][s] - runs[2][s]) < 1e-4 for s in runs[1]), runs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["data.path=nothing/*.jsonl"], "data.path=nothing/*.jsonl matches no file"),
        (["data.path=nokey.jsonl"], "data.text_key=text: nokey.jsonl has no 'text' field (it has body)"),
        (["data.tokenizer=broken.json"], "data.tokenizer=broken.json: cannot read broken.json"),
        (["data.tokenizer=missing.json"], "data.tokenizer=missing.json: no such file or folder"),
        (["model.vocab_size=256"], f"model.vocab_size=256 is smaller than the {VOCAB} tokens of data.tokenizer="),
        (["data.tokenizer=null"], "data.tokenizer is missing"),
        (["data.val_path=val.bin"], "data.val_path is a token file for data=tokens"),
    ],
)
def test_bad_text_input_is_one_line_before_any_worker(
    corpus: Path, tmp_path: Path, args: list[str], expected: str
) -> None:
    (tmp_path / "nokey.jsonl").write_text(json.dumps({"body": "no text field"}) + "\n")
    (tmp_path / "broken.json").write_text("{not a tokenizer")
    result = run_cli("train", *text_args(corpus, tmp_path / "cache", "corpus/*"), *args, cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)
    assert not list((tmp_path / "cache").glob("text-*")), "bad input builds no cache"


def test_token_width_follows_the_vocabulary() -> None:
    """uint16 holds ids up to 65535: a larger vocabulary (Llama 3's 128256) is stored as uint32."""
    widths = {v: TextCache(Path("t"), Path("d"), v).dtype for v in (512, 65536, 65537, 128256)}
    assert widths == {512: np.uint16, 65536: np.uint16, 65537: np.uint32, 128256: np.uint32}
