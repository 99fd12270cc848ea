"""profile.start/steps: a Chrome trace per rank under run_dir/profile/ for exactly the asked steps, and
one line per rank of its top ops; a window outside the run, or a memory snapshot off CUDA, is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.config.validate import validate
from launcher.errors import LauncherError
from launcher.train.loop import train
from tests.conftest import run_cli, run_for, tiny_args, tiny_config


@pytest.mark.slow
def test_profile_writes_a_trace_of_the_asked_steps_and_a_top_ops_line(tmp_path: Path) -> None:
    run = tmp_path / "r"
    summary = train(run_for(tiny_config(tmp_path, "steps=4", "profile.start=2", "profile.steps=2")), run)
    trace = json.loads((run / "profile" / "rank0.trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step_")}
    assert steps == {"step_2", "step_3"}
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    [line] = summary["profile"]
    assert line.startswith("rank 0: top ops by self CPU time: ") and line.count("%") == 5


@pytest.mark.slow
def test_every_rank_traces_and_reports_one_line(tmp_path: Path) -> None:
    run = tmp_path / "r"
    args = [*tiny_args(tmp_path / "cache", steps=2), "tp=2", "profile.start=2", "metrics.console=plain"]
    result = run_cli("train", *args, "hardware.peak_tflops=1.0", f"run_dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0.trace.json", "rank1.trace.json"]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ") and "top ops" in line]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("steps=4", "profile.start=5"), "profile.start=5 is after the last step (steps=4)"),
        (("profile.start=1", "profile.memory=true"), "profile.memory=true dumps a CUDA memory snapshot"),
    ],
)
def test_bad_profile_windows_are_one_line(tmp_path: Path, overrides: tuple[str, ...], expected: str) -> None:
    with pytest.raises(LauncherError, match=re.escape(expected)):
        validate(tiny_config(tmp_path, *overrides))
