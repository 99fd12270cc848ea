"""bench/gpu_check.py on a machine without a GPU: one line and a non-zero exit, at once; its helpers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.gpu_check import GROUPED_RTOL, close, profile_for
from bench.gpu_moe import compare_paths
from tests.conftest import ROOT


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
    assert profile_for(name) == profile


def test_losses_compared_step_by_step() -> None:
    assert close({1: 10.0, 2: 9.0}, {1: 10.05, 2: 9.0, 3: 8.0}, 1e-2)[0]
    assert not close({1: 10.0, 2: 9.5}, {1: 10.0, 2: 9.0}, 1e-2)[0]


def test_expert_paths_compared_on_uneven_unaligned_groups() -> None:
    """gpu_check's grouped-vs-loop comparison, run here on CPU (torch._grouped_mm runs there too)."""
    r = compare_paths(torch.device("cpu"), experts=8, dim=64, hidden=32, rows=300, repeats=1)
    assert sum(r["counts"]) == 300 and r["counts"][0] == 0 and any(c % 8 for c in r["counts"])
    assert len(r["max_rel_diff"]) == 5 and max(r["max_rel_diff"]) <= GROUPED_RTOL
    assert r["loop_ms"] > 0 and r["grouped_ms"] > 0
