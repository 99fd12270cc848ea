"""Checkpoint writes that fail loudly and safely: one line naming the cause, every rank agreeing, the
previous checkpoint kept, a failed final save ending the run; save figures against the planner's."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from launcher.errors import CheckpointFailed
from launcher.planner import resolve
from launcher.train import ckpt_write
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.ckpt_write import cause
from launcher.train.faults import TEST_DISK_FULL_ENV
from launcher.train.loop import train
from tests.conftest import losses, run_cli, run_for, tiny_args, tiny_config


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_cause_is_the_errno_or_the_free_space(tmp_path: Path, monkeypatch) -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/x/__0_0.distcp")
    try:  # torch's zip writer hides the OSError behind a RuntimeError raised while handling it
        try:
            raise full
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as err:
        hidden = err
    assert cause(hidden, tmp_path, 1) == "no space left on device (/x/__0_0.distcp)"
    denied = CheckpointException("save", {1: (PermissionError(errno.EACCES, "Permission denied"), None)})
    assert cause(denied, tmp_path, 1) == "permission denied (rank 1)"  # DCP: another rank's failure
    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\nmore")
    monkeypatch.setattr(ckpt_write, "free_bytes", lambda root: 3 * 2**20)
    assert cause(bare, tmp_path, 4 * 2**20).startswith(f"disk full? 3.00 MiB free on {tmp_path} (RuntimeError: ")
    assert cause(bare, tmp_path, 2**20).endswith("unexpected pos 704 vs 598")  # room enough: not the disk


def test_failed_save_is_one_line_training_goes_on_and_resumes_exactly(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(TEST_DISK_FULL_ENV, "4")
    run = tmp_path / "r"
    summary = train(run_for(tiny_config(tmp_path, "steps=6", "checkpoint.every=2")), run)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        f"warning: checkpoint at step 4 failed: no space left on device ({run}/checkpoints/step_00000004.partial); "
        f"{run}/checkpoints/step_00000004.partial removed, kept {run}/checkpoints/step_00000002"
    ]
    assert names(run / "checkpoints") == ["step_00000002", "step_00000006"]
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert rows[2]["ckpt_bytes"] == rows[6]["ckpt_bytes"] > 0 and "ckpt_bytes" not in rows[4]
    assert summary["checkpoint_save_s"]["count"] == 2
    assert summary["checkpoint_bytes_per_rank"] == [rows[2]["ckpt_bytes"]]
    monkeypatch.delenv(TEST_DISK_FULL_ENV)
    resumed = tmp_path / "resumed"
    train(run_for(tiny_config(tmp_path, "steps=6", f"resume={run / 'checkpoints' / 'step_00000002'}")), resumed)
    assert losses(resumed) == {s: loss for s, loss in losses(run).items() if s > 2}


@pytest.mark.parametrize("setting", ["checkpoint.on_error=stop", "checkpoint.async_save=true"])
def test_stop_or_a_failed_final_save_ends_the_run(tmp_path: Path, monkeypatch, setting: str) -> None:
    """on_error=stop: a periodic save that fails stops the run; async: the final save's failure, found
    when the run waits for it, stops it whatever on_error says."""
    at = 2 if "stop" in setting else 4
    monkeypatch.setenv(TEST_DISK_FULL_ENV, str(at))
    run = tmp_path / "r"
    with pytest.raises(CheckpointFailed, match=f"checkpoint at step {at} failed: no space left on device"):
        train(run_for(tiny_config(tmp_path, "steps=4", "checkpoint.every=2", setting)), run)
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == (["step_00000002"] if at == 4 else [])
    assert not list((run / "checkpoints").glob("*.partial"))


@pytest.mark.slow
def test_final_save_failing_on_one_rank_exits_non_zero_in_one_line(tmp_path: Path) -> None:
    """Through the CLI, two ranks (FSDP): rank 1's disk is full at the last step; both ranks agree, the
    run exits 1 with one line, the previous checkpoint is intact; the saves' bytes match the planner's."""
    args = [*tiny_args(tmp_path / "cache", steps=4), "dp=2", "checkpoint.every=2", f"run_dir={tmp_path / 'r'}"]
    result = run_cli("train", *args, env={TEST_DISK_FULL_ENV: "4:1"}, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint at step 4 failed: no space left on device")
    assert "(rank 1)" in lines[0] and "kept " in lines[0] and "Traceback" not in result.stdout + result.stderr
    root = tmp_path / "r" / "checkpoints"
    assert names(root) == ["step_00000002"]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    measured = [r["ckpt_bytes"] for r in rows if "ckpt_bytes" in r]
    _, prediction, _ = resolve(tiny_config(tmp_path, "dp=2"))
    assert len(measured) == 1 and measured[0] == pytest.approx(prediction.memory.checkpoint, rel=0.01)
