"""`plan.calibrate`: the profile's constants fitted to measured runs (launcher/planner/calibrate_fit.py, calibrate.py).

The fitter on synthetic runs (measured = predicted with known multipliers: it must find them, within
their bounds), the calibrated profile as a YAML the planner reads, the one-line errors, and end to end:
real CPU runs, a profile mis-set on purpose, a layout held out of the fit predicted better after it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path

import pytest
import yaml

from launcher.config.hardware import HardwareConfig, LinkConfig
from launcher.config.layout_keys import from_config
from launcher.config.schema import TrainConfig
from launcher.config.validate import check_calibrate
from launcher.errors import LauncherError
from launcher.hardware.profile import machine
from launcher.planner import calibrate_fit as fit_module
from launcher.planner.calibrate import calibrate
from launcher.planner.calibrate_fit import Observation, fit, held_out, knobs, seen, step_times
from launcher.planner.predict import problem_memory
from launcher.planner.request import problem
from tests.conftest import make_config, run_cli, tiny_args

# a cpu profile with every number given: nothing is calibrated, the runs below are all synthetic
FIXED = (
    "hardware=cpu",
    "hardware.peak_tflops=0.1",
    "hardware.matmul_efficiency=0.5",
    "hardware.nonmatmul_width=180",
    "hardware.host_overhead_us=3000",
    "hardware.block_overhead_us=600",
    "hardware.optimizer_ns_per_param=1",
    "hardware.host_copy_ns_per_byte=0.5",
    "hardware.links.0.bandwidth_gbs=0.9",
    "hardware.links.0.latency_us=1000",
)
LAYOUTS = ({"micro": 2}, {}, {"tp": 2}, {"dp": 2}, {"tp": 2, "dp": 2}, {"pp": 2}, {"micro": 8})


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> list[TrainConfig]:
    """The config of each of LAYOUTS on the fixed profile (composed once: Hydra takes a while)."""
    base = make_config(*tiny_args(tmp_path_factory.mktemp("cache")), *FIXED)
    return [
        dataclasses.replace(base, batch={**base.batch, "micro": lay.pop("micro", 4)}, **lay)
        for lay in map(dict, LAYOUTS)
    ]


def synthetic(configs: list[TrainConfig], truth: dict[str, float]) -> list[Observation]:
    """Runs of LAYOUTS whose 'measured' step is the prediction with the knobs at `truth`."""
    runs = []
    for cfg in configs:
        layout = from_config(cfg, None)
        prob = problem(cfg, layout.world_size)
        runs.append(Observation(str(layout), layout, prob, problem_memory(prob, layout), 1.0, 1))
    found = knobs(configs[0].hardware, runs[0].problem.machine)
    measured = step_times(runs, found, [truth.get(k.key, 1.0) for k in found])
    return [dataclasses.replace(r, measured_s=t) for r, t in zip(runs, measured)]


def fitted(runs: list[Observation], hw: HardwareConfig) -> dict[str, float]:
    found = knobs(hw, runs[0].problem.machine)
    kept = [k for k, moved in zip(found, seen(runs, found)) if moved]
    return dict(zip((k.key for k in kept), fit(runs, kept)))


TRUTH = {"matmul_efficiency": 0.5, "links.shared_memory": 0.4, "block_overhead_us": 2.0}


def test_the_fit_recovers_known_multipliers(configs: list[TrainConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit_module, "RIDGE", 0.0)  # the least-squares solution alone
    mults = fitted(synthetic(configs, TRUTH), configs[0].hardware)
    assert len(mults) == 6  # efficiency, the link, 4 host times: each moves some run's prediction
    for key, m in mults.items():
        assert m == pytest.approx(TRUTH.get(key, 1.0), rel=0.02), (key, mults)


def test_the_ridge_moves_little_while_the_runs_are_fitted(configs: list[TrainConfig]) -> None:
    runs = synthetic(configs, TRUTH)
    mults = fitted(runs, configs[0].hardware)
    for key, m in mults.items():
        assert m == pytest.approx(TRUTH.get(key, 1.0), rel=0.15), (key, mults)
    found = knobs(configs[0].hardware, runs[0].problem.machine)
    after = step_times(runs, found, list(mults.values()))
    assert max(abs(a / r.measured_s - 1) for a, r in zip(after, runs)) < 0.03


def test_bounds_hold_where_the_runs_ask_for_more(configs: list[TrainConfig]) -> None:
    """Runs faster than an efficiency of 1 allows: the fit stops at 1, it does not invent FLOPs."""
    runs = [dataclasses.replace(r, measured_s=r.measured_s / 3) for r in synthetic(configs, {})]
    found = knobs(configs[0].hardware, runs[0].problem.machine)
    mults = fit(runs, found)
    for knob, m in zip(found, mults):
        assert knob.lo <= m <= knob.hi * (1 + 1e-9), knob
    assert mults[0] == pytest.approx(found[0].hi, rel=1e-3)  # matmul_efficiency 0.5 x 2 = 1.0


def test_datasheet_links_cannot_beat_their_datasheet() -> None:
    hw = HardwareConfig(name="h", kind="cuda", peak_tflops=100.0, links=[LinkConfig("nvlink", 8, 450.0, 1.0)])
    found = knobs(hw, machine(hw, 1, ""))
    link = next(k for k in found if k.key == "links.nvlink")
    assert link.hi == pytest.approx(1 / 0.8)  # the planner reads 80% of a datasheet rate; at most all of it
    assert [k.key for k in found] == ["matmul_efficiency", "links.nvlink"]  # no host times on a GPU


def test_every_third_layout_is_held_out(configs: list[TrainConfig]) -> None:
    runs = synthetic(configs, {})
    labels = sorted({r.label for r in runs})
    assert held_out(runs) == {labels[2], labels[5]}
    assert held_out(runs[:2]) == set()


def write_summaries(tmp_path: Path, configs: list[TrainConfig], runs: list[Observation]) -> Path:
    """Each synthetic run as a summary.json in its own directory, as `train` writes it."""
    for i, (cfg, run) in enumerate(zip(configs, runs)):
        tokens = run.layout.global_batch * cfg.seq_len
        summary = {
            "config": dataclasses.asdict(cfg),
            "layout": dataclasses.asdict(run.layout),
            "world_size": run.layout.world_size,
            "median_tokens_per_s": tokens / run.measured_s,
            "threads_per_worker": 1,
        }
        (tmp_path / "runs" / str(i)).mkdir(parents=True)
        (tmp_path / "runs" / str(i) / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "runs" / "failed").mkdir()
    (tmp_path / "runs" / "failed" / "summary.json").write_text('{"status": "failed", "error": "x"}')
    return tmp_path / "runs"


def test_calibrate_writes_a_profile_the_planner_reads(tmp_path: Path, configs: list[TrainConfig]) -> None:
    folder = write_summaries(tmp_path, configs, synthetic(configs, {"matmul_efficiency": 0.6}))
    out = io.StringIO()
    path = calibrate(str(folder), configs[0].hardware, str(tmp_path / "cal"), "", "json", out)
    result = json.loads(out.getvalue())
    assert path == tmp_path / "cal" / "hardware" / "cpu_calibrated.yaml"
    assert result["error"]["held_out"]["after"] < 0.02 < result["error"]["held_out"]["before"]
    assert [line.endswith("failed: failed or preempted") for line in result["skipped"]] == [True]
    assert result["constants"]["matmul_efficiency"]["after"] == pytest.approx(0.3, rel=0.02)
    profile = yaml.safe_load(path.read_text())
    assert profile["name"] == "cpu_calibrated" and profile["links"][0]["efficiency"] == 1.0
    # the YAML is a HardwareConfig; the planner reads the link as written (0.9 GB/s x 0.8, reached)
    hw = HardwareConfig(**{**profile, "links": [LinkConfig(**link) for link in profile["links"]]})
    level = machine(hw, 1, "").levels[0]
    assert level.bandwidth == pytest.approx(0.9e9 * 0.8, rel=0.01)


def test_bad_directories_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match=r"plan.calibrate: no directory 'nope'"):
        check_calibrate("nope")
    with pytest.raises(LauncherError, match=r"no summary.json under it"):
        check_calibrate([str(tmp_path)])
    with pytest.raises(LauncherError, match=r"give a directory, or a list of them"):
        check_calibrate(3)


def test_runs_of_another_profile_are_refused(tmp_path: Path, configs: list[TrainConfig]) -> None:
    folder = write_summaries(tmp_path, configs[:1], synthetic(configs[:1], {}))
    hw = make_config("hardware=h100_sxm").hardware
    with pytest.raises(LauncherError, match=r"ran on hardware 'cpu', not 'h100_sxm': pass hardware=cpu"):
        calibrate(str(folder), hw, str(tmp_path / "cal"), "", "table", io.StringIO())


@pytest.mark.slow
def test_a_calibrated_cpu_profile_predicts_a_held_out_layout_better(tmp_path: Path) -> None:
    """Real runs of four layouts on this CPU (three in-process, tp=2 through `train`); `plan.calibrate`
    against the cpu profile with its compute and host time set 4-8x off on purpose; the layout held
    out of the fit (micro-batch 4: labels sort "16x1", "2x1", "4x1", so the fit interpolates, as a
    sweep's held-out point mostly does) must be predicted better after than before."""
    from launcher.train.loop import train
    from tests.conftest import run_for

    common = (*tiny_args(tmp_path / "cache", steps=8), "seq_len=64", "checkpoint.every=0")
    for micro in (2, 4, 16):
        cfg = make_config(*common, f"batch.micro={micro}")
        train(run_for(cfg), tmp_path / "runs" / f"micro{micro}")
    tp2 = run_cli("train", *common, "batch.micro=4", "tp=2", f"run_dir={tmp_path / 'runs' / 'tp2'}", cwd=tmp_path)
    assert tp2.returncode == 0, tp2.stderr[-2000:]
    peak = json.loads((tmp_path / "runs" / "micro2" / "summary.json").read_text())["peak_flops_per_device"]
    wrong = make_config(
        "hardware=cpu", f"hardware.peak_tflops={4 * peak / 1e12}", "hardware.matmul_efficiency=1.0",
        "hardware.block_overhead_us=100",
    ).hardware  # fmt: skip
    out = io.StringIO()
    path = calibrate(str(tmp_path / "runs"), wrong, str(tmp_path / "cal"), make_config().cache_dir, "json", out)
    result = json.loads(out.getvalue())
    rows = {Path(r["run"]).name: r for r in result["runs"]}
    print(json.dumps(result["error"]), {k: round(r["error_after"], 3) for k, r in rows.items()})
    assert [name for name, r in rows.items() if r["held_out"]] == ["micro4"]
    before, after = abs(rows["micro4"]["error_before"]), abs(rows["micro4"]["error_after"])
    # quiet, 86% -> 14%; beside another worker's tests the measured steps are noise (seen: 85% -> 48%,
    # and in CI 88% -> 82% with the fitted runs themselves 40% off): the fit must move the held-out
    # layout towards the truth, by how much is the load's to say (the fit's accuracy on steps that follow
    # the model is test_calibrate_writes_a_profile_the_planner_reads's)
    assert before > 0.5 and after < before, rows["micro4"]
    assert result["error"]["fitted"]["after"] < result["error"]["fitted"]["before"]
    plan = run_cli("plan", f"--config-dir={path.parent.parent}", "hardware=cpu_calibrated", "+model=tiny", "tp=2")
    assert plan.returncode == 0 and "cpu_calibrated" in plan.stdout, plan.stderr[-2000:]
    assert not math.isnan(result["constants"]["matmul_efficiency"]["after"])
