"""`doctor`: exit 0 on a machine with nothing wrong, and each missing piece as one line of its own."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from launcher.config.schema import compose_config
from launcher.launch import doctor
from launcher.launch.doctor import Finding, Setting, findings, in_range
from tests.conftest import run_cli

CHECKS = ["torch", "cuda", "attention", "compile", "process group", "slurm", "run_dir", "cache_dir", "peak", "extras"]


def setting(tmp: Path, hardware: str = "cpu", compile: bool = False) -> Setting:
    return Setting(compose_config(f"hardware={hardware}").hardware, tmp / "runs", tmp / "cache", compile)


def by_name(s: Setting) -> dict[str, Finding]:
    return {f.name: f for f in findings(s)}


@pytest.mark.slow
def test_doctor_on_this_machine_exits_0_one_line_per_check(tmp_path: Path) -> None:
    result = run_cli("doctor", f"run_dir={tmp_path / 'runs'}", f"cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("doctor: hardware=cpu") and lines[-1].startswith("doctor: ")
    assert {line.split()[0] for line in lines[1:-1]} <= {"ok", "warning"}  # a busy machine may warn on its peak
    assert [line[9:24].strip() for line in lines[1:-1]] == CHECKS


def test_a_gpu_profile_without_a_gpu_fails_that_line_only(tmp_path: Path) -> None:
    found = by_name(setting(tmp_path, "h200"))
    assert found["cuda"] == Finding("fail", "cuda", "no CUDA device: hardware=h200 needs one")
    assert [f.name for f in found.values() if f.status == "fail"] == ["cuda"]


def test_disk_full_or_read_only_is_a_fail_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: usage._replace(free=2**20))
    assert by_name(setting(tmp_path))["run_dir"].status == "fail"
    monkeypatch.undo()
    monkeypatch.setattr(doctor.os, "access", lambda p, mode: False)
    line = by_name(setting(tmp_path))["cache_dir"]
    assert line.status == "fail" and "is not writable: choose another cache_dir" in line.detail


def test_missing_extras_are_one_warning_naming_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "installed", lambda module: module not in ("wandb", "matplotlib"))
    line = doctor.check_extras()
    assert line == Finding("warning", "extras", "missing plot, wandb: pip install 'launcher[plot,wandb]'")


def test_a_check_that_breaks_is_its_own_fail_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Finding:
        raise RuntimeError("driver mismatch\nmore")

    monkeypatch.setattr(doctor, "check_slurm", broken)
    found = by_name(setting(tmp_path))
    assert found["slurm"] == Finding("fail", "slurm", "RuntimeError: driver mismatch")
    assert found["extras"].status in ("ok", "warning")  # the checks after it still ran


def test_compile_check_compiles_a_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same code path a GPU takes; on this CPU through aot_eager (inductor's C++ build takes minutes here)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    found = doctor.check_compile(setting(tmp_path, compile=True))
    assert found.status == "ok" and "1 module compiled into 1 graph, no graph break" in found.detail
    assert "compile=true checks it" in doctor.check_compile(setting(tmp_path)).detail


def test_compile_check_warns_of_a_graph_break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.model import transformer

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    norm = transformer.make_norm

    def breaking_norm(cfg: object) -> torch.nn.Module:  # a norm the compiler cannot trace
        module = norm(cfg)
        module.register_forward_hook(lambda *_: torch._dynamo.graph_break())
        return module

    monkeypatch.setattr(transformer, "make_norm", breaking_norm)
    found = doctor.check_compile(setting(tmp_path, compile=True))
    assert found.status == "warning" and "graph breaks: parts of blocks run eagerly" in found.detail


@pytest.mark.parametrize(
    ("version", "spec", "inside"),
    [
        ("2.13.0+cpu", ">=2.11,<2.16", True),
        ("2.11.0+cu130", ">=2.11,<2.16", True),
        ("2.10.1", ">=2.11,<2.16", False),
        ("2.16.0.dev20270101", ">=2.11,<2.16", False),
        ("2.13.0", "", True),
    ],
)
def test_torch_range(version: str, spec: str, inside: bool) -> None:
    assert in_range(version, spec) is inside


@pytest.mark.slow
def test_unknown_option_is_one_line(tmp_path: Path) -> None:
    result = run_cli("doctor", "hardwre=h200", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: doctor: unknown option 'hardwre': use hardware=, run_dir=, cache_dir= or compile="
    ]


def test_a_peak_cached_on_a_busy_machine_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GEMM peak cached low (calibrated under load) made every MFU since read high: doctor re-measures it."""
    import json
    import os

    from launcher.hardware import probes
    from launcher.hardware.probes.gemm import _gemm_key, gemm_record

    s = setting(tmp_path)
    threads = os.cpu_count() or 1
    path = tmp_path / "cache" / "calibration.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({probes.cache.full_key(_gemm_key(threads)): gemm_record(threads, 1e9)}))
    monkeypatch.setattr(probes, "measure_gemm_flops", lambda threads, seconds, trials: 5e9)
    found = doctor.check_peak(s)
    assert found.status == "ok" and "raised from 1 to 5 GFLOP/s" in found.detail
    assert probes.cached_gemm_flops(threads, str(tmp_path / "cache")) == 5e9
