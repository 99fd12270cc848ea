"""Sweeps: the end-of-multirun summary (table, csv/json, chart, failed points) and the layout sweeper."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from launcher.launch.sweep import summarize
from tests.conftest import run_cli, tiny_args


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def tiny(cache: str, steps: int = 3) -> list[str]:
    return [*tiny_args(cache, steps), "checkpoint.every=0"]


def sweep_dir(out: Path) -> Path:
    (found,) = [p for p in out.glob("*/*") if p.is_dir()]
    return found


@pytest.mark.slow
def test_failed_point_is_listed_and_the_sweep_goes_on(tmp_path: Path, cache: str) -> None:
    out = run_cli("train", "-m", *tiny(cache), "batch.micro=4,0", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    sweep = sweep_dir(tmp_path)
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert [(r["point"], r["status"]) for r in rows] == [("batch.micro=4", "ok"), ("batch.micro=0", "failed")]
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["mfu"] > 0
    assert rows[0]["predicted_tokens_per_s"] > 0  # the planner's, from summary.json
    assert rows[1]["error"] == "batch.micro=0 is out of range: use an integer >= 1 or auto"  # the exception's message
    assert (rows[1]["error_type"], rows[1]["exit_code"]) == ("LauncherError", 2)
    assert "1 of 2 sweep points failed" in out.stdout and "#1 batch.micro=0: batch.micro=0" in out.stdout
    with (sweep / "sweep_summary.csv").open() as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok", "failed"]
    assert (sweep / "sweep_summary.png").read_bytes()[:4] == b"\x89PNG"
    assert (sweep / "sweep_losses.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_layout_sweep_tp_pp(tmp_path: Path, cache: str) -> None:
    """`train -m tp=1,2 pp=1,2`: every layout runs (local workers), one summary at the end."""
    out = run_cli("train", "-m", *tiny(cache, steps=2), "tp=1,2", "pp=1,2", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((sweep_dir(tmp_path) / "sweep_summary.json").read_text())
    assert [r["layout"] for r in rows] == ["tp1 pp1 dp1", "tp1 pp2 dp1", "tp2 pp1 dp1", "tp2 pp2 dp1"]
    assert all(r["status"] == "ok" for r in rows), [(r["point"], r["error"]) for r in rows]
    assert [r["world_size"] for r in rows] == [1, 2, 2, 4]
    # one global batch for all: without it the pp=2 points would train 4x the pp=1 points' sequences
    assert {r["global_batch"] for r in rows} == {16}, [(r["point"], r["global_batch"]) for r in rows]
    assert "every point trains batch.global=16 (defaults tp=1 pp=1: 4, tp=1 pp=2: 16" in out.stdout + out.stderr


@pytest.mark.slow
def test_layouts_sweeper_runs_the_planners_best(tmp_path: Path, cache: str) -> None:
    out = run_cli("train", "-m", "hydra/sweeper=layouts", "sweep.top=2", "sweep.world=2", *tiny(cache), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("layout #") == 2  # the ranked layouts, logged before they run
    rows = json.loads((sweep_dir(tmp_path) / "sweep_summary.json").read_text())
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), rows
    assert all(r["world_size"] == 2 for r in rows)
    assert len({r["layout"] for r in rows}) == 2, [r["layout"] for r in rows]
    assert all("tp=" in r["overrides"] and "dp_shard=" in r["overrides"] for r in rows)


@pytest.mark.slow
def test_layouts_sweeper_bad_top_is_one_line(tmp_path: Path, cache: str) -> None:
    out = run_cli("train", "-m", "hydra/sweeper=layouts", "sweep.top=0", *tiny(cache), cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: sweep.top=0 is out of range: use an integer >= 1"]


@pytest.mark.slow
def test_summary_with_prediction_and_a_job_that_never_finished(tmp_path: Path) -> None:
    for num, summary in enumerate(
        [
            {
                "median_tokens_per_s": 1000.0,
                "median_mfu": 0.2,
                "final_loss": 5.0,
                "world_size": 2,
                "layout": {"tp": 2, "pp": 1, "dp_replicate": 1, "dp_shard": 1},
                "prediction": {"tokens_per_s": 1200.0, "mfu": 0.25, "memory_gib": 0.1},
            },
            None,
        ]
    ):
        job = tmp_path / str(num) / ".hydra"
        job.mkdir(parents=True)
        (job / "overrides.yaml").write_text(f"- tp={2 - num}\n")
        if summary:
            (tmp_path / str(num) / "summary.json").write_text(json.dumps(summary))
    with (tmp_path / "out.txt").open("w") as f:
        rows = summarize(tmp_path, file=f)
    assert rows[0]["predicted_tokens_per_s"] == 1200.0 and rows[0]["layout"] == "tp2 pp1 dp1"
    assert rows[1]["status"] == "failed" and "did not finish" in rows[1]["error"]
    assert (tmp_path / "sweep_summary.png").exists()
    assert "1 of 2 sweep points failed" in (tmp_path / "out.txt").read_text()


def test_points_of_different_global_batches_are_said_to_be_unlike(tmp_path: Path) -> None:
    """Without batch.global a pp=2 point trains more sequences a step than a pp=1 point (microbatches
    2 x pp): the summary says so in one line, instead of comparing them silently."""
    for num, (pp, batch) in enumerate([(1, 8), (2, 32)]):
        job = tmp_path / str(num) / ".hydra"
        job.mkdir(parents=True)
        (job / "overrides.yaml").write_text(f"- pp={pp}\n")
        summary = {"median_tokens_per_s": 1000.0, "median_mfu": 0.2, "final_loss": 5.0, "world_size": pp}
        summary["prediction"] = {"tokens_per_s": 1200.0, "mfu": 0.25, "memory_gib": 0.1, "global_batch": batch}
        (tmp_path / str(num) / "summary.json").write_text(json.dumps(summary))
    with (tmp_path / "out.txt").open("w") as f:
        summarize(tmp_path, file=f)
    text = (tmp_path / "out.txt").read_text()
    assert "note: the points trained different global batches (pp=1: 8, pp=2: 32): set batch.global" in text
    assert "off the prediction" not in text  # 1000 against 1200: within reach


def test_points_far_off_their_prediction_are_named(tmp_path: Path) -> None:
    """On a busy machine the predicted column was 9x off with no word said."""
    for num, measured in enumerate([1000.0, 120.0]):
        job = tmp_path / str(num) / ".hydra"
        job.mkdir(parents=True)
        (job / "overrides.yaml").write_text(f"- tp={num + 1}\n")
        summary = {"median_tokens_per_s": measured, "median_mfu": 0.2, "final_loss": 5.0, "world_size": 1}
        summary["prediction"] = {"tokens_per_s": 1080.0, "mfu": 0.25, "memory_gib": 0.1, "global_batch": 8}
        (tmp_path / str(num) / "summary.json").write_text(json.dumps(summary))
    with (tmp_path / "out.txt").open("w") as f:
        summarize(tmp_path, file=f)
    text = (tmp_path / "out.txt").read_text()
    assert "note: measured tokens/s 3x or more off the prediction (tp=2: 0.11x, load now" in text
    assert "tp=1:" not in text.split("off the prediction")[1]


def test_the_common_batch_is_the_least_common_multiple_where_points_differ() -> None:
    from hydra_plugins.layout_sweeper.fixed_batch import common_batch

    assert common_batch([8, 32, None, 24]) == 96  # each point's own batch divides it
    assert common_batch([16, 16]) is None  # alike already: nothing pinned
    assert common_batch([None, 8]) is None


@pytest.mark.parametrize("override", ["batch.global=64", "microbatches=2", "+microbatches=4"])
def test_a_sweep_that_sets_the_batch_keeps_it(override: str) -> None:
    from hydra_plugins.layout_sweeper.fixed_batch import FixedBatch

    # decided from the overrides alone, before any point is composed (no loader here to compose with)
    assert FixedBatch().fixed_batch([["pp=1", override], ["pp=2", override]]) is None
