"""Checkpoints: exact resume, pruning, corrupt and bad checkpoints, a full disk, preemption, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launcher.errors import PREEMPTED, LauncherError
from launcher.model import Transformer
from launcher.model.init import initialized_model
from launcher.train.ckpt_pick import complete_checkpoints, resolve_resume
from launcher.train.loop import train
from tests.conftest import losses, run_cli, run_for, tiny_config


def test_resume_is_exact(tmp_path: Path) -> None:
    full = tmp_path / "full"
    train(run_for(tiny_config(tmp_path, "steps=8", "checkpoint.every=4")), full)
    assert [p.name for p in complete_checkpoints(full / "checkpoints")] == ["step_00000008", "step_00000004"]
    resumed = tmp_path / "resumed"
    train(run_for(tiny_config(tmp_path, "steps=8", f"resume={full / 'checkpoints' / 'step_00000004'}")), resumed)
    expected = losses(full)
    assert losses(resumed) == {s: expected[s] for s in range(5, 9)}


def test_keep_prunes_oldest_only_after_newer_complete(tmp_path: Path) -> None:
    train(run_for(tiny_config(tmp_path, "steps=8", "checkpoint.every=2", "checkpoint.keep=2")), tmp_path / "r")
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert names == ["step_00000006", "step_00000008"]


def test_corrupt_newest_falls_back_to_previous_and_keeps_it(tmp_path: Path, capsys) -> None:
    run = tmp_path / "r"
    train(run_for(tiny_config(tmp_path, "steps=8", "checkpoint.every=4")), run)
    newest = run / "checkpoints" / "step_00000008"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    summary = train(run_for(tiny_config(tmp_path, "steps=10", "checkpoint.every=0")), run)
    assert "unreadable" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 10 and [r["step"] for r in rows[8:]] == [5, 6, 7, 8, 9, 10]  # from step 4, not 8
    # step 4's weights and data position came back: step 5 has the loss it had (later steps follow steps=10's schedule)
    assert rows[8]["loss"] == rows[4]["loss"]
    assert (run / "checkpoints" / "step_00000004" / "complete.json").exists()
    assert newest.exists(), "a checkpoint is never deleted on load"


def test_partial_checkpoint_is_never_loaded(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step_00000009.partial").mkdir(parents=True)
    (root / "step_00000007").mkdir()  # no marker: incomplete
    assert complete_checkpoints(root) == []


@pytest.mark.slow
def test_bad_resume_paths_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match="no such path"):
        resolve_resume(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(LauncherError, match="holds no complete checkpoint"):
        resolve_resume(str(tmp_path), tmp_path)
    result = run_cli("train", f"resume={tmp_path / 'missing'}", "steps=1", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "resume=" in result.stderr


def test_other_model_shape_names_the_tensor(tmp_path: Path) -> None:
    run = tmp_path / "r"
    train(run_for(tiny_config(tmp_path, "steps=2", "checkpoint.every=2")), run)
    with pytest.raises(LauncherError, match=r"holds .*weight with shape .* but the model has"):
        train(run_for(tiny_config(tmp_path, "steps=4", "model.ffn_dim=64")), run)


def test_full_disk_keeps_previous_checkpoint_and_training_goes_on(tmp_path: Path, monkeypatch, capsys) -> None:
    from torch.distributed.checkpoint import filesystem

    real, calls = filesystem.FileSystemWriter.write_data, []

    def failing(self, plan, planner):  # the second save finds the disk full
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", failing)
    run = tmp_path / "r"
    summary = train(run_for(tiny_config(tmp_path, "steps=6", "checkpoint.every=2", "checkpoint.keep=1")), run)
    assert summary["steps"] == 6
    assert "no space left on device" in capsys.readouterr().out
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000006"], names  # step 2 kept until step 6 completed; no partial folder left


@pytest.mark.slow
def test_sigterm_saves_current_step_exits_preempted_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "r"
    common = [
        "+model=tiny",
        "seq_len=32",
        "batch.micro=2",
        "metrics.console=plain",
        "metrics.wandb.mode=disabled",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_bytes=100000",
        f"run_dir={run}",
        "checkpoint.every=0",
    ]
    exe = str(Path(run_cli.__globals__["sys"].executable).parent / "train")
    proc = subprocess.Popen(
        [exe, "steps=100000", *common], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    jsonl = run / "metrics.jsonl"
    deadline = time.time() + 60
    while not (jsonl.exists() and jsonl.read_text().count("\n") >= 3) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED, err
    assert b"preempted at step" in err
    last = max(losses(run))
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == [f"step_{last:08d}"]
    result = run_cli("train", f"steps={last + 2}", *common, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"resumed from step {last}" in result.stdout
    assert max(losses(run)) == last + 2


@pytest.mark.slow
def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_round_trip_gives_the_same_logits(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "steps=3", "checkpoint.every=3")
    train(run_for(cfg), tmp_path / "r")
    result = run_cli(
        "export-weights", str(tmp_path / "r" / "checkpoints"), str(tmp_path / "model.safetensors"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    out = Path(result.stdout.strip())
    assert f"step_00000003 of {tmp_path / 'r' / 'checkpoints'} written to {out} (safetensors," in result.stderr
    assert out.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # as any file the user writes (not 0600)
    exported = Transformer(cfg.model)
    exported.load_state_dict(load_file(str(out)), strict=True)
    from launcher.train.checkpoint import Checkpointer
    from launcher.train.optim import build_optimizer

    reference = initialized_model(cfg.model, cfg.seed, torch.device("cpu"))
    optimizer, _ = build_optimizer([reference], cfg.optim, cfg.steps)
    Checkpointer(cfg.checkpoint, tmp_path / "r" / "checkpoints", 0).load(
        complete_checkpoints(tmp_path / "r" / "checkpoints"), [reference], optimizer
    )
    tokens = torch.randint(0, 256, (2, 16))
    assert not torch.equal(
        reference(tokens), initialized_model(cfg.model, cfg.seed, torch.device("cpu"))(tokens)
    )  # trained
    torch.testing.assert_close(exported(tokens), reference(tokens), rtol=0, atol=0)


def test_async_save_completes_and_resumes_exactly(tmp_path: Path) -> None:
    full = tmp_path / "full"
    train(run_for(tiny_config(tmp_path, "steps=8", "checkpoint.every=4", "checkpoint.async_save=true")), full)
    assert [p.name for p in complete_checkpoints(full / "checkpoints")] == ["step_00000008", "step_00000004"]
    assert not list((full / "checkpoints").glob("*.partial"))
    resumed = tmp_path / "resumed"
    train(run_for(tiny_config(tmp_path, "steps=8", f"resume={full / 'checkpoints' / 'step_00000004'}")), resumed)
    expected = losses(full)
    assert losses(resumed) == {s: expected[s] for s in range(5, 9)}
