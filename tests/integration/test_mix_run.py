"""data=mix end to end: a mixture run with a skipped batch resumes exactly on two data-parallel ranks,
and a resume with other weights begins a new phase, says so, and logs figures per source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from launcher.launch.spawn import start_local_workers
from launcher.train.loop import train
from tests.conftest import assert_bad_input, losses, run_cli, run_for, tiny_config

pytestmark = pytest.mark.slow

COMMON = ("hardware.peak_tflops=1.0", "steps=6", "batch.global=8", "threads=1", "guard.skip_batches=[[2,2]]")


def sources(tmp_path: Path, weights: tuple[int, int, int]) -> tuple[str, ...]:
    for name, top in (("a", 200), ("b", 50)):
        if not (tmp_path / f"{name}.bin").exists():
            np.random.default_rng(top).integers(0, top, 20_000).astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    py, a, b = weights
    listed = (
        f"[{{name: stdlib, weight: {py}, label: py}}, {{name: tokens, path: '{tmp_path}/a.bin', weight: {a}}},"
        f" {{name: tokens, path: '{tmp_path}/b.bin', weight: {b}, label: small}}]"
    )
    return ("data=mix", f"data.sources={listed}")


def run(tmp_path: Path, name: str, weights: tuple[int, int, int], *overrides: str) -> Path:
    job, run_dir = (
        run_for(tiny_config(tmp_path, *COMMON, *sources(tmp_path, weights), *overrides), None),
        tmp_path / name,
    )
    if job.layout.world_size == 1:
        train(job, run_dir)
    else:
        start_local_workers(job, run_dir)
    return run_dir


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mixture_resumes_on_two_ranks_and_changes_phase(tmp_path: Path) -> None:
    whole = run(tmp_path, "whole", (3, 2, 1), "checkpoint.every=0", "metrics.log_every=1")
    saved = run(tmp_path, "saved", (3, 2, 1), "checkpoint.every=3", "steps=3")
    checkpoint = saved / "checkpoints" / "step_00000003"
    resumed = run(tmp_path, "resumed", (3, 2, 1), f"resume={checkpoint}", "checkpoint.every=0", "dp=2")
    expected = {s: v for s, v in losses(whole).items() if s > 3}
    assert losses(resumed) == pytest.approx(expected, rel=1e-5)
    by_step = {r["step"]: r for r in rows(whole)}
    for row in rows(resumed):  # the same sequences of each source, on two ranks
        for key in ("loss.py", "loss.tokens", "loss.small", "tokens.py", "tokens.tokens", "tokens.small"):
            assert row[key] == pytest.approx(by_step[row["step"]][key], rel=1e-5)
    summary = json.loads((whole / "summary.json").read_text())
    assert sum(summary[f"tokens.{s}"] for s in ("py", "tokens", "small")) == 6 * 8 * 32
    assert abs(summary["share.py"] - 0.5) <= 1 / 48 and abs(summary["share.small"] - 1 / 6) < 2 / 48

    phase = run(tmp_path, "phase", (1, 1, 6), f"resume={checkpoint}", "checkpoint.every=0")
    log = (phase / "rank0.log").read_text()
    assert "data: new mixture phase at sample 32 (shares py 0.5->0.125, tokens 0.333->0.125, small 0.167->0.75" in log
    summary = json.loads((phase / "summary.json").read_text())
    assert summary["share.small"] == pytest.approx(0.75, abs=1 / 24)  # steps 4-6: 24 sequences


@pytest.mark.parametrize(
    ("listed", "expected"),
    [
        ("[{name: stdlib, weight: 0}]", "data.sources[0].weight=0: give a number > 0"),
        ("[{name: stdlib, weight: 1}, {name: tokens, path: short.bin, weight: 1}]", "data.sources[1] (tokens): "),
    ],
)
def test_bad_mixtures_through_the_cli(listed: str, expected: str, tmp_path: Path) -> None:
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "short.bin")
    result = run_cli("train", "data=mix", f"data.sources={listed}", "steps=1", cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)
