"""Shared fixtures: compose the real Hydra config in-process, and run the CLI as a user would.

Two tiers: `make test` runs every test, `make test-fast` those not marked `slow`. A test is marked
`slow` (by hand: `@pytest.mark.slow`, or `pytestmark` for a file that is all slow) when it starts
processes - gloo workers (tests/dist.py, `start_local_workers`), the CLI (`run_cli`, `run_shell`), SLURM -
or trains in-process for more than ~2 s.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from launcher.config.layout_keys import from_config
from launcher.config.run import Run
from launcher.config.schema import TrainConfig, compose_config
from launcher.files import HYDRA_ONLY
from launcher.launch.cli import run_of
from launcher.planner import Prediction, build_options, resolve
from launcher.planner.memory import Memory

ROOT = Path(__file__).resolve().parent.parent


make_config = compose_config


def tiny_args(cache: str | Path, steps: int = 4) -> list[str]:
    """Overrides for a seconds-long, quiet CPU run of the tiny model with its own data cache."""
    return [
        "+model=tiny",
        f"steps={steps}",
        "seq_len=32",
        "batch.micro=4",
        "eval.every=0",
        "metrics.console=none",
        "metrics.wandb.mode=disabled",
        f"data.cache_dir={cache}",
        "data.max_bytes=200000",
        "threads=1",
    ]


def tiny_config(tmp_path: Path, *overrides: str) -> TrainConfig:
    """The TrainConfig of `tiny_args` (later overrides win)."""
    return make_config(*tiny_args(tmp_path / "cache"), *overrides)


def run_for(cfg: TrainConfig, world: int | None = 1, prediction: Prediction | None = None) -> Run:
    """The Run `train` hands its ranks for `cfg` on `world` ranks (None: the degrees' product), with
    `prediction` as the planner's (None: none, so that nothing here depends on the calibration)."""
    layout = from_config(cfg, world)
    return run_of(cfg, layout, prediction, build_options(cfg, layout))


def predicted_at(cfg: TrainConfig, gib: float) -> Prediction:
    """The planner's prediction for `cfg` on one rank with its memory total set to `gib` GiB (what a
    test compares the measured or the refused memory with). `cfg` must give hardware.peak_tflops, so
    that nothing is calibrated."""
    prediction = resolve(cfg, 1)[1]
    zero = {key: 0.0 for key in ("grads", "optimizer", "buffers", "activations", "logits", "overhead")}
    return dataclasses.replace(prediction, memory=Memory(params=gib * 2**30, **zero))


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a console script of this venv (train, plan) and capture its output."""
    exe = Path(sys.executable).parent / args[0]
    full_env = {**os.environ, "LAUNCHER_OUTPUTS": str(cwd or ROOT / "outputs"), **(env or {})}
    return subprocess.run(
        [str(exe), *args[1:]], capture_output=True, text=True, env=full_env, cwd=cwd or ROOT, timeout=600
    )


def symm_mem_needs_enabling() -> bool:
    """Whether this torch's `is_symm_mem_enabled_for_group` (what async TP's pass checks) reads the registry
    that `enable_symm_mem_for_group` fills (2.11-2.14); from 2.15 it holds wherever an allocator exists (CUDA)."""
    import inspect

    from torch.distributed import _symmetric_memory as symm_mem

    return "_group_name_to_store" in inspect.getsource(symm_mem.is_symm_mem_enabled_for_group)


def run_shell(line: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command line in a fresh bash, as a user types it, with this venv's console scripts first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "LAUNCHER_OUTPUTS": str(cwd or ROOT / "outputs")}
    return subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", line],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd or ROOT,
        timeout=600,
    )


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step from a run's metrics.jsonl; a step trained again (resume, restart) keeps its last value."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def worker_pids(parent: int) -> list[int]:
    """Local workers of a `train` process: the children of its forkserver (launcher/launch/spawn.py)."""
    procs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                procs.append((int(entry.name), ppid, (entry / "cmdline").read_bytes()))
            except OSError:
                continue
    servers = {pid for pid, ppid, cmdline in procs if ppid == parent and b"forkserver" in cmdline}
    return [pid for pid, ppid, _ in procs if ppid in servers]


def assert_bad_input(result: subprocess.CompletedProcess, expected: str, where: Path) -> None:
    """Refused as bad input: exit 2, one `error:` line holding `expected`, no traceback, and no worker
    started (no metrics.jsonl under `where`)."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert not list(where.rglob("metrics.jsonl")), "no worker may start on bad input"
    left = [d for d in where.glob("outputs/*/*") if not {p.name for p in d.iterdir()} - HYDRA_ONLY]
    assert not left, f"bad input left folders of Hydra's files alone: {left}"


def selected_cases(request: pytest.FixtureRequest, **axes: Iterable[str]) -> list[tuple[str, ...]]:
    """The combinations of the parameters `axes` (name: every value) that the session's selected tests
    in the requesting module read, so that a module fixture runs only those (`make test-compat`
    selects a few by node id); every combination when a selected test there lacks one of the axes."""
    every = list(itertools.product(*axes.values()))
    chosen = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None or not set(axes) <= set(callspec.params):
            return every
        chosen.add(tuple(callspec.params[name] for name in axes))
    return [case for case in every if case in chosen]


@pytest.fixture
def cache_dir(tmp_path: Path) -> str:
    return str(tmp_path / "cache")


@pytest.fixture(scope="session", autouse=True)
def calibrated_cpu() -> None:
    """Calibrate this machine's cpu profile up front (once per machine, cached) for every thread count
    a worker may get, so no test's output carries the one-time "calibrating" note."""
    from launcher.hardware.profile import machine
    from launcher.layout import worker_threads

    cfg = compose_config()
    for threads in {worker_threads(None, workers) for workers in (1, 2, 4, 8)}:
        machine(cfg.hardware, threads, cfg.cache_dir)
