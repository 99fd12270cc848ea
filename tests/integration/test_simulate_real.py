"""The simulation checked against a real run (issue 44): `train ... simulate=true` (its tracked peak plus the planner's
per-device overhead, on a CPU the worker process itself) against the peak RSS the same layout's real run measures.
`python -m bench simulate_real` runs every model and layout; bench/RESULTS.md has its figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.simulate_real import TOLERANCE, compare, error

pytestmark = pytest.mark.slow


def test_the_simulated_peak_of_tiny_at_tp_2_is_the_measured_one(tmp_path: Path) -> None:
    """`tiny` holds ~0.02 GiB of tensors beside a ~0.24 GiB process: this checks the process's share (the planner's
    cpu overhead) and the simulation end to end; the tensors' share is checked to the byte by
    tests/unit/test_simulate.py and at 1b width by the benchmark (within 1% of lean RSS). Both runs measure RSS less
    mapped files: with them, a fresh venv's torch (cached by the kernel in large folios) put `tiny` at 0.38 GiB in CI
    against 0.30 here (-16%)."""
    row = compare(["+model=tiny", "tp=2", "data.max_bytes=200000"], tmp_path, str(tmp_path / "cache"), lean=False)
    measured = max(row["measured"])
    assert len(row["measured"]) == 2 and not row["stopped"]
    assert 0 < row["tracked"][0] < row["simulated"]
    assert abs(error(row["simulated"], measured)) <= TOLERANCE, row
