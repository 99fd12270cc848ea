"""Local workers through elastic launch: the whole loop under tp x pp matches one process, and a
worker that dies takes the job down with its rank and error, never a hang."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launcher.errors import FAILED, WorkerFailed
from launcher.launch.spawn import first_cause, start_local_workers
from launcher.train.loop import train
from tests.conftest import run_for, tiny_config


@pytest.mark.slow
def test_train_tp2_pp2_matches_one_process(tmp_path: Path) -> None:
    overrides = ("hardware.peak_tflops=1.0", "steps=3", "batch.global=8", "eval.every=3", "eval.batches=1")
    single = tiny_config(tmp_path, *overrides, f"run_dir={tmp_path / 'single'}")
    ref = train(run_for(single), tmp_path / "single")
    cfg = tiny_config(tmp_path, *overrides, "tp=2", "pp=2", "pp_schedule=gpipe", "threads=1")
    summary = start_local_workers(run_for(cfg, None), tmp_path / "par")
    assert summary["world_size"] == 4 and summary["layout"]["pp"] == 2
    assert summary["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
    assert summary["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4)
    rows = [json.loads(line) for line in (tmp_path / "par" / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], rel=1e-4)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref_rows], rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "par").glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]


def test_the_cause_is_the_first_failure_never_a_peers_lost_connection() -> None:
    """Under load the peer's 'connection closed' can carry the earlier timestamp: it never names the cause."""
    from types import SimpleNamespace

    def failure(message: str, timestamp: int) -> SimpleNamespace:
        return SimpleNamespace(message={"message": message}, timestamp=timestamp)

    lost = failure("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:41628", 100)
    cause = failure("IsADirectoryError: [Errno 21] Is a directory: 'metrics.jsonl'", 101)
    assert first_cause({1: lost, 0: cause})[0] == 0
    assert first_cause({1: failure("ValueError: x", 100), 0: failure("ValueError: y", 100)})[0] == 0
    assert first_cause({1: failure("ValueError: x", 99), 0: failure("ValueError: y", 100)})[0] == 1


@pytest.mark.slow
def test_a_dying_worker_takes_the_job_down_with_its_rank_and_error(tmp_path: Path) -> None:
    """Rank 0 (the output owner) cannot open its metrics file; rank 1 is already waiting in a
    tensor-parallel collective: the agent must stop it, and the error must name rank 0."""
    cfg = tiny_config(tmp_path, "hardware.peak_tflops=1.0", "tp=2")
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker rank 0 failed \(exit 1\): IsADirectoryError") as failed:
        start_local_workers(run_for(cfg, None), run_dir)
    assert failed.value.exit_code == FAILED  # what `train` exits with
    assert time.monotonic() - start < 90
