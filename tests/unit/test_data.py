"""Token sources and the deterministic, resumable, DP-sharded loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from launcher.config.schema import DataConfig
from launcher.data import BatchLoader, load_splits
from launcher.data.corpus import stdlib_files
from launcher.errors import LauncherError


def test_stdlib_corpus_is_cached_split_and_bytes(tmp_path: Path) -> None:
    cfg = DataConfig(cache_dir=str(tmp_path), max_bytes=300_000, val_fraction=0.1)
    first = load_splits(cfg)
    assert first.train.size + first.val.size == 300_000 and first.val.size == 30_000
    assert first.vocab_size == 256 and first.train.dtype == np.uint8
    assert len(list(tmp_path.glob("stdlib-*.u8"))) == 1
    again = load_splits(cfg)  # served from the cache, identical
    assert np.array_equal(first.train, again.train)
    assert stdlib_files() == sorted(stdlib_files(), key=lambda p: p.as_posix())


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_are_memory_mapped(tmp_path: Path, dtype: str) -> None:
    path = tmp_path / "train.bin"
    np.arange(5000, dtype=dtype).tofile(path)
    splits = load_splits(DataConfig(name="tokens", path=str(path), dtype=dtype, val_fraction=0.2))
    assert isinstance(splits.train, np.memmap)
    assert splits.train.size == 4000 and int(splits.val[0]) == 4000


def test_missing_token_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match="data.path=.*no such file"):
        load_splits(DataConfig(name="tokens", path=str(tmp_path / "nope.bin")))


def tokens() -> np.ndarray:
    return np.arange(10_000, dtype=np.uint16) % 997


def test_batches_are_deterministic_by_seed_and_targets_shift() -> None:
    a = BatchLoader(tokens(), 16, 8, seed=3)
    b = BatchLoader(tokens(), 16, 8, seed=3)
    c = BatchLoader(tokens(), 16, 8, seed=4)
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert torch.equal(xa, xb) and not torch.equal(xa, c.next_batch()[0])
    assert torch.equal(xa[:, 1:], ya[:, :-1])


def test_data_parallel_ranks_split_the_same_global_batch() -> None:
    whole = BatchLoader(tokens(), 16, 8, seed=1)
    ranks = [BatchLoader(tokens(), 16, 8, dp_rank=r, dp_size=4, seed=1) for r in range(4)]
    for _ in range(3):
        expected = whole.next_batch()[0]
        assert torch.equal(torch.cat([r.next_batch()[0] for r in ranks]), expected)


def test_resume_from_state_under_another_dp_size() -> None:
    run = BatchLoader(tokens(), 16, 8, seed=1)
    run.next_batch()
    state = run.state_dict()
    expected = run.next_batch()[0]
    resumed = [BatchLoader(tokens(), 16, 8, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    assert torch.equal(torch.cat([r.next_batch()[0] for r in resumed]), expected)
