"""Signals to `train`: SIGINT, SIGTERM and SIGUSR1 sent to the command (the launcher of local workers, or
the one process) save every rank at the same step and exit 75 without a traceback, and the rerun goes on
exactly as an uninterrupted run; a second Ctrl-C stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.errors import INTERRUPTED, PREEMPTED
from launcher.train.ckpt_pick import complete_checkpoints
from launcher.train.preemption import PreemptionFlag
from tests.conftest import losses, run_cli, tiny_args, worker_pids

STEPS = 40  # ~35 ms each: the signal, sent after step 3, lands well before the end


def train_args(cache: Path, run_dir: Path, tp: int) -> list[str]:
    plain = ["metrics.console=plain", "hardware.peak_tflops=1.0", "checkpoint.every=0"]
    return [*tiny_args(cache, STEPS), *plain, f"tp={tp}", f"run_dir={run_dir}"]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """`train` in a session of its own, so that a signal reaches only it, as `kill PID` would."""
    exe = str(Path(sys.executable).parent / "train")
    env = {**os.environ, "LAUNCHER_OUTPUTS": str(cwd)}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    # SIGHUP at its default, as a terminal starts it: an ignored one (a suite run under nohup) is inherited
    hangup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        return subprocess.Popen([exe, *args], cwd=cwd, env=env, start_new_session=True, **pipes)
    finally:
        signal.signal(signal.SIGHUP, hangup)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    jsonl, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while not (jsonl.exists() and jsonl.read_text().count("\n") >= step):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("signals")  # one data cache and one uninterrupted run per tp for all cases


@pytest.fixture(scope="module")
def uninterrupted(shared: Path) -> Callable[[int], dict[int, float]]:
    runs: dict[int, dict[int, float]] = {}

    def losses_of(tp: int) -> dict[int, float]:
        if tp not in runs:
            run_dir = shared / f"whole_tp{tp}"
            result = run_cli("train", *train_args(shared / "cache", run_dir, tp), cwd=shared)
            assert result.returncode == 0, result.stderr
            runs[tp] = losses(run_dir)
        return runs[tp]

    return losses_of


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "tp"),
    [(signal.SIGINT, 2), (signal.SIGTERM, 2), (signal.SIGUSR1, 2), (signal.SIGINT, 1)],
    ids=["sigint-workers", "sigterm-workers", "sigusr1-workers", "sigint-one-process"],
)
def test_a_signal_saves_every_rank_at_one_step_exits_75_and_the_rerun_resumes_exactly(
    tmp_path: Path, shared: Path, uninterrupted: Callable[[int], dict[int, float]], sig: signal.Signals, tp: int
) -> None:
    run_dir = tmp_path / "run"
    args = train_args(shared / "cache", run_dir, tp)
    proc = start(args, tmp_path)
    wait_for_step(proc, run_dir, 3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED, err
    assert "Traceback" not in err, err
    step = max(losses(run_dir))
    assert 3 <= step < STEPS
    assert f"preempted at step {step}: checkpoint saved under {run_dir / 'checkpoints'}" in err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the stop request travels with each rank's memory figure: every logged row has every rank's
    assert all(len(r["mem_gib_per_rank"]) == tp and r["mem_gib"] == max(r["mem_gib_per_rank"]) > 0 for r in rows)
    saved = complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in saved] == [f"step_{step:08d}"]
    assert sorted(p.name for p in saved[0].glob("rng_rank*.pt")) == [f"rng_rank{r}.pt" for r in range(tp)]

    rerun = run_cli("train", *args, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resumed from step {step}" in rerun.stdout
    got, whole = losses(run_dir), uninterrupted(tp)
    assert [got[s] for s in range(step + 1, STEPS + 1)] == [whole[s] for s in range(step + 1, STEPS + 1)]


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_while_the_workers_start_saves_at_the_first_step(tmp_path: Path, shared: Path) -> None:
    """A terminal sends Ctrl-C to its whole foreground group, workers included, here before they have
    even imported torch: they ignore it, the launcher forwards it, and it waits for the first step."""
    run_dir = tmp_path / "run"
    proc = start(train_args(shared / "cache", run_dir, tp=2), tmp_path)
    deadline = time.monotonic() + 120
    while len(worker_pids(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # the group of train's own session: train and its workers only
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED, err
    assert "Traceback" not in err, err
    assert "preempted at step 1: checkpoint saved" in err
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000001"]


@pytest.mark.slow
@pytest.mark.parametrize("signals", [(signal.SIGINT, signal.SIGINT), (signal.SIGHUP,)], ids=["second-ctrl-c", "sighup"])
def test_a_second_ctrl_c_kills_the_workers_at_once(tmp_path: Path, shared: Path, signals: tuple[int, ...]) -> None:
    """The workers are stopped (SIGSTOP), as if stuck in a long step, so a first Ctrl-C cannot be
    honoured; the second (or a hangup) must still end the command at once, workers included, without
    a traceback."""
    run_dir = tmp_path / "run"
    proc = start(train_args(shared / "cache", run_dir, tp=2), tmp_path)
    wait_for_step(proc, run_dir, 3)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    for sig in signals:
        time.sleep(0.5)  # two signals at once would be one
        start_s = time.monotonic()
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - start_s < 10  # torch would wait 30 s for the workers before killing them
    assert proc.returncode == INTERRUPTED, err
    assert "Traceback" not in err and "interrupted" in err, err
    assert not complete_checkpoints(run_dir / "checkpoints")
    assert all(not alive(pid) for pid in workers), workers


def alive(pid: int) -> bool:
    """Running, or stopped, as opposed to gone or a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_second_ctrl_c_in_one_process_raises_keyboard_interrupt_and_restores_the_handlers() -> None:
    before = signal.getsignal(signal.SIGINT)
    flag = PreemptionFlag()
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # "save and stop" again: the same request
        assert flag.raised
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        flag.restore()
