"""The watchdog (launcher/train/watchdog.py): a SIGSTOPped worker under tp=2 is named with its phase and
step within `watchdog.timeout_s` + 10 s, then the group restarts from the last checkpoint or the run
exits HUNG; a rank sleeping while its peer waits in a collective is named as the one stuck; a rank run
here (torchrun, SLURM: no local agent) finds its stopped peer itself and exits HUNG with the line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from launcher.config.schema import WatchdogConfig
from launcher.errors import HUNG
from launcher.train.faults import TEST_HANG_ENV
from launcher.train.timeouts import timeout_for
from launcher.train.watchdog import Beat, describe
from tests.conftest import losses, tiny_args

TIMEOUT_S = 5.0
LATENCY_S = TIMEOUT_S + 10  # the promised bound: from the stop to the line


def args(cache: Path, run_dir: Path, *extra: str) -> list[str]:
    plain = ["metrics.console=plain", "hardware.peak_tflops=1.0", "tp=2", f"watchdog.timeout_s={TIMEOUT_S}"]
    return [*tiny_args(cache, 10), *plain, f"run_dir={run_dir}", *extra]


def train(cwd: Path, argv: list[str], **env: str) -> subprocess.Popen:
    exe = str(Path(sys.executable).parent / "train")
    full = {**os.environ, "LAUNCHER_OUTPUTS": str(cwd), **env}
    return subprocess.Popen([exe, *argv], cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def cwd(tmp_path: Path) -> Iterator[Path]:
    """The test's directory; afterwards every process started under it (a stopped worker too) is killed."""
    yield tmp_path
    marker = f"LAUNCHER_OUTPUTS={tmp_path}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue


def stderr_stamped(proc: subprocess.Popen, timeout: float = 180.0) -> tuple[str, float]:
    """The process's stderr, and when its `error: ` line arrived: the bound is on the line, not on the
    interpreter's exit after it, which a loaded machine stretches by seconds."""
    stamped: list[tuple[float, str]] = []
    readers = [
        threading.Thread(target=proc.stdout.read),
        threading.Thread(target=lambda: stamped.extend((time.time(), line) for line in proc.stderr)),
    ]
    for reader in readers:
        reader.start()
    proc.wait(timeout)
    for reader in readers:
        reader.join(timeout)
    named = [t for t, line in stamped if line.startswith("error: ")]
    return "".join(line for _, line in stamped), min(named, default=float("inf"))


def stopped_at(run_dir: Path, rank: int) -> float:
    """When the injected stop happened: the stopped rank's last beat, written just before it."""
    return json.loads((run_dir / "watchdog" / f"rank_{rank}.json").read_text())["time"]


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_stopped_worker_is_named_with_its_phase_and_the_run_exits_hung(cwd: Path) -> None:
    run_dir = cwd / "run"
    proc = train(cwd, args(cwd / "cache", run_dir, "checkpoint.every=0"), **{TEST_HANG_ENV: "3:1:stop"})
    err, named = stderr_stamped(proc)
    assert proc.returncode == HUNG, err[-3000:]
    line = error_line(err)
    assert "rank 1 stopped responding (not scheduled / stopped" in line, line
    assert "in phase forward_backward at step 3" in line and "rank 0 waiting in phase forward_backward" in line
    assert f"{run_dir / 'watchdog'}/rank_N.stacks" in line
    latency = named - stopped_at(run_dir, 1)
    print(f"detection latency (stop -> line): {latency:.1f} s with watchdog.timeout_s={TIMEOUT_S}")
    assert latency < LATENCY_S
    stacks = (run_dir / "watchdog" / "rank_0.stacks").read_text()  # the waiting rank, inside its collective
    assert "in forward_backward" in stacks and "_functional_collectives" in stacks, stacks


@pytest.mark.slow
def test_a_stopped_worker_restarts_the_group_from_the_last_checkpoint(cwd: Path) -> None:
    run_dir = cwd / "run"
    argv = args(cwd / "cache", run_dir, "checkpoint.every=2", "max_restarts=1")
    proc = train(cwd, argv, **{TEST_HANG_ENV: "5:1:stop"})  # first attempt only: the restart runs through
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    hung = [line for line in err.splitlines() if line.startswith("watchdog: ")]
    assert len(hung) == 1 and "rank 1 stopped responding" in hung[0], err[-3000:]
    assert hung[0].endswith("; restarting from the last checkpoint") and "at step 5" in hung[0]
    assert "resumed from step 4" in out
    assert sorted(losses(run_dir)) == list(range(1, 11))


@pytest.mark.slow
def test_a_slow_rank_is_named_and_its_peer_waits_in_its_collective(cwd: Path) -> None:
    run_dir = cwd / "run"
    proc = train(cwd, args(cwd / "cache", run_dir, "checkpoint.every=0"), **{TEST_HANG_ENV: "3:1:sleep"})
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == HUNG, err[-3000:]
    line = error_line(err)
    assert "rank 1 stuck in phase data at step 3" in line, line
    assert "rank 0 waiting in phase forward_backward at step 3" in line, line
    assert "time.sleep" not in line and "stall" in (run_dir / "watchdog" / "rank_1.stacks").read_text()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_rank_run_here_finds_its_stopped_peer_and_exits_hung(cwd: Path) -> None:
    """As under torchrun or SLURM: each rank is its own `train` (RANK, WORLD_SIZE), no local agent."""
    run_dir, port = cwd / "run", str(free_port())
    argv = args(cwd / "cache", run_dir, "checkpoint.every=0")
    ranks = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", TEST_HANG_ENV: "3:1:stop"}
    procs = [train(cwd, argv, RANK=str(rank), LOCAL_RANK=str(rank), **ranks) for rank in (0, 1)]
    err, named = stderr_stamped(procs[0])
    assert procs[0].returncode == HUNG, err[-3000:]
    assert procs[1].poll() is None, "rank 1 is stopped, not gone"
    line = error_line(err)
    assert "rank 1 stopped responding" in line and "in phase forward_backward at step 3" in line, line
    assert named - stopped_at(run_dir, 1) < LATENCY_S


def beat(rank: int, step: int, phase: str, since: float, written: float) -> Beat:
    return Beat(rank, 100 + rank, "host", "run/0", step, phase, since, written, TIMEOUT_S)


def test_describe_names_who_stopped_and_who_waits() -> None:
    now = 1000.0
    stopped = {0: beat(0, 7, "forward_backward", 990, now), 1: beat(1, 7, "forward_backward", 991, 991)}
    assert describe(stopped, now, 2.0).startswith("rank 1 stopped responding")
    behind = {
        0: beat(0, 7, "optimizer", 990, now),
        1: beat(1, 7, "data", 980, now),
        2: beat(2, 7, "optimizer", 990, now),
    }
    assert describe(behind, now, 2.0) == (
        "rank 1 stuck in phase data at step 7 for 20 s; ranks 0, 2 waiting in phase optimizer at step 7"
    )
    alike = {0: beat(0, 7, "optimizer", 990, now), 1: beat(1, 7, "optimizer", 990, now)}
    assert describe(alike, now, 2.0).count("stuck in phase optimizer") == 2
    assert describe({0: alike[0], 1: None}, now, 2.0).startswith("rank 1 never reported")


def test_the_timeout_fits_the_predicted_step_with_a_floor() -> None:
    assert timeout_for(WatchdogConfig(), "cpu", 0.0) == 60
    assert timeout_for(WatchdogConfig(), "cuda", 0.5) == 300
    assert timeout_for(WatchdogConfig(), "cuda", 30.0) == 600
    assert timeout_for(WatchdogConfig(timeout_s=0), "cuda", 0.0) == 0


def test_gloo_process_group_timeout_follows_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from launcher.launch.rank_env import RankEnv
    from launcher.launch.spawn import join_group
    from tests.conftest import run_for, tiny_config

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    join_group(run_for(tiny_config(tmp_path, "nccl_timeout_s=42")), RankEnv(0, 1, 0), tmp_path)
    assert seen["backend"] == "gloo" and seen["timeout"] == timedelta(seconds=42)
    join_group(run_for(tiny_config(tmp_path, "watchdog.timeout_s=200")), RankEnv(0, 1, 0), tmp_path)
    assert seen["timeout"] == timedelta(seconds=5 * 200 + 120)  # past the first step's allowance


def test_the_collective_timeout_outlasts_the_watchdogs_first_step() -> None:
    """A GPU's default watchdog gives the first step (eight ranks compiling) 5 x 300 s: NCCL's 600 s
    would cut the run off before the watchdog could name the rank that is stuck."""
    from launcher.config.schema import WatchdogConfig
    from launcher.train.timeouts import SLOW_FACTOR, collective_timeout_s

    gpu = timeout_for(WatchdogConfig(), "cuda", 0.0)
    assert collective_timeout_s(None, gpu) > SLOW_FACTOR * gpu == 1500
    assert collective_timeout_s(None, 0.0) == 600  # watchdog off: NCCL's default
    assert collective_timeout_s(None, 60.0) == 600  # a CPU's: 600 s already outlasts it
    assert collective_timeout_s(900, gpu) == 900  # given: as given


def test_flight_recorder_trace_is_a_pickle_of_this_process() -> None:
    import pickle

    from launcher.compat.torch_compat import flight_recorder_trace

    assert isinstance(pickle.loads(flight_recorder_trace()), dict)
