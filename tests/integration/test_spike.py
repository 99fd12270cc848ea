"""Loss spikes (`guard.spike`): a poisoned batch (LAUNCHER_TEST_SPIKE) spikes the loss and the gradient norm;
`rollback` puts back the last snapshot and trains on exactly as a run that never saw the batches since
(`guard.skip_batches`), in one process and under tp=2; `skip` drops the update as `optim.skip_nonfinite`
drops a NaN's; `off` lets it in; past `guard.max_rollbacks` the run stops (exit 3, one line); skipped
batches survive a resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from launcher.config.validate import validate
from launcher.data import BatchLoader
from launcher.errors import NON_FINITE, LauncherError
from launcher.launch.spawn import start_local_workers
from launcher.train.faults import TEST_NAN_ENV, TEST_SPIKE_ENV
from launcher.train.loop import train
from launcher.train.spike import Detector
from tests.conftest import losses, make_config, run_cli, run_for, tiny_args, tiny_config

# checked from step 6 (after 2 warm-up steps, a window of 3); a snapshot every 3 steps
GUARD = ("guard.warmup=2", "guard.window=3", "guard.snapshot_every=3", "checkpoint.every=0", "hardware.peak_tflops=1.0")


def run(tmp_path: Path, name: str, *overrides: str) -> Path:
    cfg = tiny_config(tmp_path, "steps=12", *GUARD, *overrides)
    job = run_for(cfg, None)
    if job.layout.world_size == 1:
        train(job, tmp_path / name)
    else:
        start_local_workers(job, tmp_path / name)
    return tmp_path / name


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def spikes(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in rows(run_dir) if "spike" in r]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_rollback_trains_on_as_a_run_that_never_saw_those_batches(
    tmp_path: Path, tp: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(TEST_SPIKE_ENV, "8")  # global batch 8, trained at step 8; the snapshot is step 6's
    rolled = run(tmp_path, "rolled", "guard.spike=rollback", f"tp={tp}", "metrics.console=plain")
    [event] = spikes(rolled)
    assert event["step"] == 8 and event["spike"] == "rollback" and event["spike_factor"] > 5
    assert event["restored_step"] == 6 and event["skipped_batches"] == [7, 8]
    if tp == 1:  # the console line (local workers' output is not captured here)
        out = capsys.readouterr().out
        assert "loss spike at step 8: loss" in out and "rolled back to step 6, batches 7-8 skipped" in out
    never = run(tmp_path, "never", "guard.skip_batches=[[7,8]]", f"tp={tp}", "metrics.console=plain")
    assert not spikes(never)
    if tp == 1:  # said, not done silently
        assert "guard.skip_batches: global batches 7-8 will not be trained on (2 batches)" in capsys.readouterr().out
    assert losses(rolled) == losses(never)  # every step, bit for bit: steps 7-12 trained on batches 9-14
    assert [r["step"] for r in rows(rolled)] == [*range(1, 9), *range(7, 13)]


@pytest.mark.slow
def test_skip_drops_the_update_as_skip_nonfinite_drops_a_nan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_SPIKE_ENV, "8")
    skipped = run(tmp_path, "skip", "guard.spike=skip")
    [event] = spikes(skipped)
    assert event["step"] == 8 and event["spike"] == "skip" and event["skipped_batches"] == [8, 8]
    monkeypatch.delenv(TEST_SPIKE_ENV)
    monkeypatch.setenv(TEST_NAN_ENV, "8")
    nan = losses(run(tmp_path, "nan", "optim.skip_nonfinite=true"))
    got = losses(skipped)
    assert [got[s] for s in range(1, 13) if s != 8] == [nan[s] for s in range(1, 13) if s != 8]


@pytest.mark.slow
def test_off_lets_the_spike_into_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_SPIKE_ENV, "8")
    off, skipped = run(tmp_path, "off"), run(tmp_path, "skip", "guard.spike=skip")
    assert not spikes(off)
    assert losses(off)[7] == losses(skipped)[7] and losses(off)[8] > 5 * losses(off)[7]  # the same spike
    assert losses(off)[9] != losses(skipped)[9]  # its update applied


@pytest.mark.slow
def test_past_max_rollbacks_the_run_stops_with_exit_3(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    args = [*tiny_args(tmp_path / "cache", steps=12), *GUARD, "guard.spike=rollback", "guard.max_rollbacks=1"]
    result = run_cli(
        "train", *args, "metrics.console=plain", f"run_dir={run_dir}", env={TEST_SPIKE_ENV: "8,11"}, cwd=tmp_path
    )
    assert result.returncode == NON_FINITE, result.stdout + result.stderr
    assert "loss spike at step 8" in result.stdout and "rolled back to step 6, batches 7-8 skipped" in result.stdout
    [line] = result.stderr.strip().splitlines()  # batch 11 trains at step 9 now
    assert line.startswith("error: loss spike at step 9 (") and "with guard.max_rollbacks=1 rollbacks done" in line
    assert line.endswith("last checkpoint: none")
    assert [e["step"] for e in spikes(run_dir)] == [8]


@pytest.mark.slow
def test_skipped_batches_and_the_detector_survive_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_SPIKE_ENV, "8")
    keys = ("guard.spike=rollback", "guard.snapshot_every=5")  # and one at the checkpoint of step 6
    whole = run(tmp_path, "whole", *keys, "guard.skip_batches=[[11,11]]", "checkpoint.every=6")
    assert [(e["restored_step"], e["skipped_batches"]) for e in spikes(whole)] == [(6, [7, 8])]
    extras = json.loads((whole / "checkpoints" / "step_00000006" / "extras.json").read_text())
    assert extras["loader"]["skipped"] == [[11, 11]] and len(extras["spike"]["window"]["losses"]) == 3
    last = json.loads((whole / "checkpoints" / "step_00000012" / "extras.json").read_text())
    assert last["loader"]["skipped"] == [[11, 11], [7, 8]] and last["spike"]["rollbacks"] == 1
    shutil.copytree(whole / "checkpoints" / "step_00000006", tmp_path / "from" / "step_00000006")
    resumed = run(tmp_path, "resumed", *keys, f"resume={tmp_path / 'from'}")  # no guard.skip_batches
    assert losses(resumed) == {s: v for s, v in losses(whole).items() if s > 6}
    assert [e["step"] for e in spikes(resumed)] == [8]  # the same spike, detected from the restored window


def test_the_loader_never_serves_skipped_batches_and_keeps_them_in_its_state() -> None:
    tokens = np.arange(5000, dtype=np.uint16)
    plain, skipping = (BatchLoader(tokens, 8, 4, dp_rank=1, dp_size=2) for _ in range(2))
    skipping.skipped = [[2, 3]]
    every = [plain.next_batch()[0] for _ in range(5)]
    first = skipping.next_batch()[0]
    assert skipping.batch_number == 1 and torch.equal(first, every[0])
    state = skipping.state_dict()
    resumed = BatchLoader(tokens, 8, 4, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert [torch.equal(resumed.next_batch()[0], every[n]) for n in (3, 4)] == [True, True]
    assert resumed.batch_number == 5 and resumed.state_dict()["skipped"] == [[2, 3]]


def test_detector_checks_once_the_window_after_warmup_is_full() -> None:
    detector = Detector(make_config("guard.warmup=1", "guard.window=2", "guard.spike_factor=3").guard)
    for step, loss in enumerate([100.0, 2.0, 2.0], start=1):  # step 1: warm-up, not counted
        assert detector.ratio(step, loss, 1.0) is None
        detector.add(step, loss, 1.0)
    assert detector.ratio(4, 6.0, 1.0) is None  # 3x: not above the factor
    assert detector.ratio(4, 2.0, 3.5) == 3.5  # the gradient norm alone
    assert detector.ratio(4, 7.0, 1.0) == 3.5
    detector.add(4, 2.0, 0.0), detector.add(5, 2.0, 0.0)  # no gradient at all: any is a spike
    assert detector.ratio(6, 2.0, 0.0) is None and detector.ratio(6, 2.0, 1e-3) == math.inf


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("guard.spike=maybe", "guard.spike=maybe: choose one of off, skip, rollback"),
        ("guard.skip_batches=[[9,7]]", "guard.skip_batches=[[9, 7]]: give [first, last] pairs"),
        ("guard.skip_batches=[[0,1]]", "guard.skip_batches=[[0, 1]] is out of range"),
        ("guard.spike_factor=1", "guard.spike_factor=1.0 is out of range: use a value > 1"),
    ],
)
def test_bad_guard_keys_name_the_key(override: str, message: str) -> None:
    with pytest.raises(LauncherError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(make_config(override))
