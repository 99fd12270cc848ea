"""The non-finite guard: a NaN injected at a given step stops the run there (exit 3, one line naming
the step, the rank and the last checkpoint, which stays intact and resumable), in one process and
across local workers; `optim.skip_nonfinite=true` skips that update and counts it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher.errors import NON_FINITE
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.faults import TEST_NAN_ENV
from launcher.train.loop import train
from launcher.train.untrusted import verify
from tests.conftest import losses, run_cli, run_for, tiny_args, tiny_config

pytestmark = pytest.mark.slow


def assert_stopped(result, step: int, rank: int, run: Path, last: int) -> None:
    assert result.returncode == NON_FINITE, result.stdout + result.stderr
    kept = run / "checkpoints" / f"step_{last:08d}"
    line = f"error: non-finite loss at step {step} on rank {rank}; last checkpoint: {kept}"
    assert result.stderr.strip().splitlines() == [line], result.stderr
    assert [p.name for p in complete_checkpoints(run / "checkpoints")][0] == kept.name
    assert not list((run / "checkpoints").glob(f"step_{step:08d}*")), "nothing saved at or after the bad step"
    verify(kept)  # intact: every file of it loads
    assert max(losses(run)) == step - 1, "the bad step is not logged as trained"


def test_nan_stops_one_process_with_exit_3_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "r"
    args = [*tiny_args(tmp_path / "cache", steps=8), "checkpoint.every=2", f"run_dir={run}"]
    result = run_cli("train", *args, env={TEST_NAN_ENV: "5"}, cwd=tmp_path)
    assert_stopped(result, 5, 0, run, last=4)
    resumed = run_cli("train", *args, cwd=tmp_path)  # without the NaN: resumes from step 4, finishes
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 4" in (run / "rank0.log").read_text() and max(losses(run)) == 8


def test_nan_on_one_data_parallel_rank_stops_every_rank(tmp_path: Path) -> None:
    run = tmp_path / "r"
    args = [*tiny_args(tmp_path / "cache", steps=6), "dp=2", "checkpoint.every=2", f"run_dir={run}"]
    result = run_cli("train", *args, "hardware.peak_tflops=1.0", env={TEST_NAN_ENV: "3:1"}, cwd=tmp_path)
    assert_stopped(result, 3, 1, run, last=2)


def test_skip_nonfinite_skips_the_update_and_counts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_NAN_ENV, "3")
    summary = train(
        run_for(tiny_config(tmp_path, "steps=5", "optim.skip_nonfinite=true", "checkpoint.every=0")), tmp_path / "r"
    )
    assert summary["skipped_steps"] == 1
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]
    assert math.isnan(rows[2]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[3:])
    monkeypatch.delenv(TEST_NAN_ENV)
    clean = train(run_for(tiny_config(tmp_path, "steps=2", "checkpoint.every=0")), tmp_path / "clean")
    assert [r["loss"] for r in rows[:2]] == list(losses(tmp_path / "clean").values())
    assert clean["skipped_steps"] == 0
