"""One run per run directory: a second `train` on a live one stops in one line and writes nothing there;
a dead holder never blocks; a SLURM requeue of the same job takes its own directory over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.errors import LauncherError
from launcher.launch.run_lock import acquire
from tests.conftest import ROOT, run_cli, tiny_args

pytestmark = pytest.mark.slow

HOLD = (
    "import time, pathlib; from launcher.launch.run_lock import acquire; "
    "acquire(pathlib.Path({path!r}), 'run_dir'); print('held', flush=True); time.sleep(600)"
)


def holding(path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Another process that holds the lock on `path` until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(path=str(path))], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_directory_is_refused_naming_the_holder_and_a_dead_one_is_free(tmp_path: Path) -> None:
    proc = holding(tmp_path)
    try:
        with pytest.raises(LauncherError, match=rf"run_dir={tmp_path} is in use by another train \(pid {proc.pid} on "):
            acquire(tmp_path, "run_dir")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert acquire(tmp_path, "run_dir") is not None  # the kernel dropped the dead holder's lock


def test_a_slurm_requeue_takes_its_own_directory_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = holding(tmp_path, {"SLURM_JOB_ID": "4242"})
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        assert acquire(tmp_path, "run_dir") is None  # the same job: proceeds without the lock
        monkeypatch.setenv("SLURM_JOB_ID", "4243")
        with pytest.raises(LauncherError, match="is in use by another train"):
            acquire(tmp_path, "run_dir")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("key", ["run_dir", "hydra.run.dir"])
def test_a_second_train_on_a_live_directory(key: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = subprocess.Popen(
        [str(Path(sys.executable).parent / "train"), *tiny_args(tmp_path / "cache", steps=100000), f"{key}={run}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "LAUNCHER_OUTPUTS": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
        before = {p: p.read_bytes() for p in run.glob(".hydra/*")}
        result = run_cli("train", *tiny_args(tmp_path / "cache2"), "seed=99", f"{key}={run}", cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: {key}={run} is in use by another train (pid {first.pid} "
        )
        assert {p: p.read_bytes() for p in run.glob(".hydra/*")} == before  # the first run's record untouched
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
