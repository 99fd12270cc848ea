"""bench/gpu_check.py: on a machine without a GPU one line and a non-zero exit, at once; its orchestration
rehearsed on this CPU (`--rehearse`) and under a deadline; its helpers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.gpu_check import GROUPED_RTOL, Check, Clock, close, failure_line, rehearsal, run_checks, run_logged
from bench.gpu_moe import compare_paths
from launcher.hardware.resolve import profile_for_device
from tests.conftest import ROOT


@pytest.mark.slow
def test_without_cuda_one_line_and_nonzero_exit() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "gpu_check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "gpu-check: no CUDA device (torch.cuda.is_available() is False): run it on an NVIDIA GPU"
    ]


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100_sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("L4", "h100_sxm"),
    ],
)
def test_profile_from_device_name(name: str, profile: str) -> None:
    assert profile_for_device(name) == profile


def test_losses_compared_step_by_step() -> None:
    assert close({1: 10.0, 2: 9.0}, {1: 10.05, 2: 9.0, 3: 8.0}, 1e-2)[0]
    assert not close({1: 10.0, 2: 9.5}, {1: 10.0, 2: 9.0}, 1e-2)[0]


def test_expert_paths_compared_on_uneven_unaligned_groups() -> None:
    """gpu_check's grouped-vs-loop comparison, run here on CPU (torch._grouped_mm runs there too)."""
    r = compare_paths(torch.device("cpu"), experts=8, dim=64, hidden=32, rows=300, repeats=1)
    assert sum(r["counts"]) == 300 and r["counts"][0] == 0 and any(c % 8 for c in r["counts"])
    assert len(r["max_rel_diff"]) == 5 and max(r["max_rel_diff"]) <= GROUPED_RTOL
    assert r["loop_ms"] > 0 and r["grouped_ms"] > 0


@pytest.mark.slow
def test_rehearsal_runs_every_check_on_this_cpu(tmp_path: Path) -> None:
    """`make gpu-check ARGS=--rehearse`: the whole orchestration, every row ok, the throughput and fp8 runs
    compiled by inductor (about two minutes on 2 idle cores with a cold compile cache)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "gpu_check", "--rehearse", f"--out={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    names = ["throughput", "compile", "fsdp: FSDP2 = no FSDP", "fsdp: save + resume", "build: steps=0", "profile"]
    assert [r["name"] for r in rows] == [*names, "moe: grouped GEMM = loop", "moe: model trains", "fp8: fp8 vs bf16"]
    assert {r["result"] for r in rows} == {"ok"}, proc.stdout
    assert rows[1]["note"] == "2 modules compiled into 1 graph, no graph break"  # inductor compiled the tiny model
    assert rows[0]["figures"]["tokens_per_s"] > 0 and rows[0]["figures"]["planned_gib"] > 0


def test_deadline_budgets_and_failures_never_stop_the_others(tmp_path: Path) -> None:
    """One that raises is a FAIL row and the rest still run, a check over its budget is cut by its timeout,
    and one with too little time left is skipped; every row lands in results.jsonl as it ends."""

    def slow(out: Path, target: object, clock: Clock) -> list[Check]:
        rc, why = run_logged(["sleep", "30"], out / "slow.log", clock)
        return [Check("slow", "FAIL" if rc else "ok", why)]

    def broken(out: Path, target: object, clock: Clock) -> list[Check]:
        raise KeyError("median_mfu")

    def quick(out: Path, target: object, clock: Clock) -> list[Check]:
        return [Check("quick", "ok", "", {"mfu": 0.5})]

    checks = [("broken", 10, broken), ("quick", 10, quick), ("slow", 2, slow), ("late", 10, quick)]
    start = time.monotonic()
    rows = run_checks(tmp_path, rehearsal(), checks, deadline_s=21.5)  # after 'slow', < 20 s left: 'late' waits
    assert time.monotonic() - start < 10
    assert [(r.name, r.result) for r in rows] == [
        ("broken", "FAIL"),
        ("quick", "ok"),
        ("slow", "FAIL"),
        ("late", "skipped"),
    ]
    assert rows[0].note == "KeyError: 'median_mfu'" and "timed out after 2 s" in rows[2].note
    saved = [json.loads(line)["name"] for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert saved == [r.name for r in rows]


def test_the_note_is_the_line_that_says_what_went_wrong() -> None:
    traceback = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory\n"
    assert failure_line(traceback + "UserWarning: something later\n") == "torch.OutOfMemoryError: CUDA out of memory"
    assert failure_line("W1202 warning: nccl\nerror: seq_len=9 exceeds\nFutureWarning: x") == "error: seq_len=9 exceeds"
    assert failure_line("some output\nlast words\nDeprecationWarning: y") == "last words"
