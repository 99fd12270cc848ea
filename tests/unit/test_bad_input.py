"""Bad input a user may type: every numeric key out of its range, every feature's key while the feature
is off, plan.calibrate's inputs, files the run cannot use, and wandb without a key or a server. Each ends
as one line and exit 2 before any worker starts, or (an unreachable wandb server) costs the run nothing."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from launcher.config.feature_keys import FEATURES, Feature, get_key
from launcher.config.ranges import Range, leaves
from launcher.config.schema import TrainConfig
from launcher.config.validate import CHOICES, check_calibrate, validate
from launcher.errors import LauncherError
from launcher.launch.cli import train_task
from launcher.planner.calibrate import calibrate
from tests.conftest import assert_bad_input, make_config, run_cli, tiny_args

# degrees and pipeline counts: int-or-auto, checked by launcher/layout/ rather than by a Range
DEGREES = {"tp", "pp", "cp", "dp", "dp_shard", "dp_replicate", "microbatches", "virtual_stages"}


def outside(rng: Range) -> list[Any]:
    """Values just outside the range, one per bound."""
    values = [rng.ge - 1 if rng.ge is not None else None, rng.gt, rng.lt, rng.le + 1 if rng.le is not None else None]
    return [v for v in values if v is not None]


def ranged_keys() -> list[tuple[str, Any]]:
    """(key, bad value) for every ranged key of the default config, read from the schema itself."""
    return [(key, bad) for key, _, rng in leaves(make_config()) if rng for bad in outside(rng)]


def with_key(cfg: TrainConfig, dotted: str, value: Any) -> TrainConfig:
    cfg = copy.deepcopy(cfg)
    *path, last = dotted.split(".")
    node: Any = cfg
    for part in path:
        node = node[int(part)] if part.isdigit() else node[part] if isinstance(node, dict) else getattr(node, part)
    if isinstance(node, dict):
        node[last] = value
    else:
        setattr(node, last, value)
    return cfg


def test_every_numeric_key_has_a_range() -> None:
    """A new int or float key must declare its range in the schema (or be a degree)."""

    def annotation(cfg: Any, key: str) -> str:
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        return next(f.type for f in dataclasses.fields(node) if f.name == name)

    cfg = make_config()
    unranged = [
        key for key, _, rng in leaves(cfg) if rng is None and re.search(r"\b(int|float)\b", annotation(cfg, key))
    ]
    assert set(unranged) <= DEGREES, sorted(set(unranged) - DEGREES)


@pytest.mark.parametrize(("key", "bad"), ranged_keys())
def test_out_of_range_is_one_line_naming_key_value_and_range(key: str, bad: Any, tmp_path: Path) -> None:
    """In-process, through the function the `train` CLI calls (the CLI turns it into exit 2)."""
    cfg = with_key(make_config(*tiny_args(tmp_path / "cache"), f"run_dir={tmp_path / 'run'}"), key, bad)
    with pytest.raises(LauncherError) as err:
        train_task(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{key}={bad} is out of range: use "), message
    assert not (tmp_path / "run").exists(), "nothing may start on bad input"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["optim.lr=-0.001"], "optim.lr=-0.001 is out of range: use a value > 0"),
        (["optim.warmup_steps=-5"], "optim.warmup_steps=-5 is out of range: use an integer >= 0"),
        (["checkpoint.every=-1"], "checkpoint.every=-1 is out of range"),
        (["eval.every=-1"], "eval.every=-1 is out of range"),
        (["max_restarts=-1"], "max_restarts=-1 is out of range"),
        (["nodes=0"], "nodes=0 is out of range: use an integer >= 1"),
        (["nodes=0", "hardware=h100_sxm"], "nodes=0 is out of range"),
        (["model.dropout=1.0"], "model.dropout=1.0 is out of range: use a value >= 0 and < 1"),
    ],
)
def test_out_of_range_through_the_cli(args: list[str], expected: str, tmp_path: Path) -> None:
    assert_bad_input(run_cli("train", *args, "steps=1", cwd=tmp_path), expected, tmp_path)


@pytest.mark.slow
def test_plan_refuses_the_same_ranges(tmp_path: Path) -> None:
    assert_bad_input(run_cli("plan", "nodes=0", cwd=tmp_path), "nodes=0 is out of range", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["data=tokens", "data.path=empty.bin"], "data.path=empty.bin: the file is empty"),
        (["data=tokens", "data.path=odd.bin"], "data.path=odd.bin: 3 bytes is not a multiple of 2 (uint16)"),
        (["data=tokens", "data.path=u16.bin", "data.dtype=uint32"], "data.path=u16.bin: 2002 bytes is not a multiple"),
        (["data=tokens", "data.path=short.bin"], "data.path=short.bin: 19 training tokens"),
        (["data=tokens", "data.path=u16.bin", "data.val_path=short.bin", "eval.every=1"], "data.val_path=short.bin"),
        (["data=tokens", "data.path=u16.bin", "data.val_path=empty.bin"], "data.val_path=empty.bin: the file is empty"),
        (["run_dir=afile/run"], "run_dir: cannot create the directory afile/run (Not a directory)"),
        (["checkpoint.dir=afile/checkpoints"], "checkpoint.dir: cannot create the directory afile/checkpoints"),
        (["data.cache_dir=afile/cache"], "data.cache_dir: cannot create the directory afile/cache"),
        (["cache_dir=afile/cache"], "cache_dir: cannot create the directory afile/cache"),
        (["slurm.emit=true", "slurm.script=afile/job.sbatch"], "slurm.script: cannot create the directory afile"),
    ],
)
def test_files_the_run_cannot_use(args: list[str], expected: str, tmp_path: Path) -> None:
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "short.bin")
    np.arange(1001, dtype=np.uint16).tofile(tmp_path / "u16.bin")
    (tmp_path / "afile").write_text("a file, not a directory\n")
    result = run_cli("train", *tiny_args(tmp_path / "cache", steps=1), "model.vocab_size=1024", *args, cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)


def wandb_env(home: Path, **extra: str) -> dict[str, str]:
    """No credentials from this machine: a clean HOME (no .netrc, no wandb settings), no key. The
    launcher's own cache (CPU calibration) stays where it is, so the run does not recalibrate."""
    cache_home = str(Path(make_config().cache_dir).parent)
    env = {"HOME": str(home), "NETRC": "", "WANDB_API_KEY": "", "WANDB_CONFIG_DIR": str(home / "wandb")}
    return {**env, "XDG_CACHE_HOME": cache_home, **extra}


@pytest.mark.slow
def test_wandb_online_without_a_key_is_one_line(tmp_path: Path) -> None:
    args = [*tiny_args(tmp_path / "cache", steps=1), "metrics.wandb.mode=online"]
    result = run_cli("train", *args, env=wandb_env(tmp_path), cwd=tmp_path)
    assert_bad_input(result, "metrics.wandb.mode=online needs a W&B API key: set WANDB_API_KEY", tmp_path)
    assert "`wandb login`" in result.stderr and "metrics.wandb.mode=offline" in result.stderr


@pytest.mark.slow
def test_wandb_server_out_of_reach_costs_the_run_nothing(tmp_path: Path) -> None:
    """A key, but the server (a closed loopback port) never answers: the run logs offline and says so once."""
    env = wandb_env(tmp_path, WANDB_API_KEY="0" * 40, WANDB_BASE_URL="http://127.0.0.1:9")
    args = [*tiny_args(tmp_path / "cache", steps=2), "metrics.wandb.mode=online", "metrics.wandb.init_timeout_s=2"]
    result = run_cli("train", *args, f"run_dir={tmp_path / 'run'}", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (warning,) = result.stderr.strip().splitlines()
    assert warning.startswith("warning: wandb could not start online") and "`wandb sync " in warning
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["pp=2", "recompute_layers=2"], "recompute_layers=2 exceeds the 1 blocks of the smallest pipeline stage"),
        (["recompute_layers=-1"], "recompute_layers=-1: expected an integer >= 0 or auto"),
        (["recompute=full", "recompute_layers=1"], "recompute_layers=1 with recompute=full"),
        (["fsdp.reshard_after_forward=sometimes"], "fsdp.reshard_after_forward=sometimes: choose one of always"),
    ],
)
def test_recompute_and_zero_keys_refused_before_spawn(args: list[str], expected: str, tmp_path: Path) -> None:
    """The tiny model has 2 blocks: pp=2 leaves 1 per stage."""
    assert_bad_input(run_cli("train", *tiny_args(tmp_path / "cache"), *args, cwd=tmp_path), expected, tmp_path)


def off_value(key: str, default: Any) -> Any:
    """A value of `key` other than its default that its other checks accept (a choice among CHOICES)."""
    if key in CHOICES:
        return next(choice for choice in CHOICES[key] if choice != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default * 2 + 2
    return {"data.sources": [{"name": "stdlib", "weight": 1}]}.get(key, 2 if default is None else "x")


def feature_cases() -> list[tuple[str, Feature]]:
    """Every key of every feature the tiny config leaves off (slurm and the sweeper are on outside hydra.main)."""
    cfg = make_config(*tiny_args("cache"))
    return [(key, f) for f in FEATURES if not f.on(cfg) for key in f.keys]


@pytest.mark.parametrize(("key", "feature"), feature_cases(), ids=[key for key, _ in feature_cases()])
def test_a_features_key_while_it_is_off(
    key: str, feature: Feature, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Class a, for every key of the table: refused naming the key and the switch, or (harmless) one warning."""
    cfg = make_config(*tiny_args(tmp_path / "cache"))
    cfg = with_key(cfg, key, off_value(key, get_key(cfg, key)))
    if feature.harmless:
        validate(cfg)
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"warning: {key}=") and f"read only with {feature.switch}" in line
        return
    with pytest.raises(LauncherError) as err:
        validate(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{key}=") and f"read only with {feature.switch}" in message


def test_every_feature_key_is_in_the_schema() -> None:
    keys = [key for feature in FEATURES for key in feature.keys]
    assert len(keys) == len(set(keys)), "a key belongs to one feature"
    for key in keys:
        get_key(make_config(), key)  # AttributeError on a key the schema does not have


@pytest.mark.parametrize(
    ("value", "summary", "expected"),
    [
        ("", None, "plan.calibrate=: give a directory"),
        (["RUN", " "], None, "give a directory, or a list of them"),
        ("RUN", "{not json", "summary.json is not a run's summary (a JSON object)"),
        ("RUN", "[1, 2]", "summary.json is not a run's summary (a JSON object)"),
        (["RUN", "MISSING"], "{}", "plan.calibrate: no directory"),
    ],
)
def test_calibrate_inputs(value: Any, summary: str | None, expected: str, tmp_path: Path) -> None:
    """Class d: plan.calibrate's garbage, lists with a missing entry, summaries that are not one."""
    (tmp_path / "run").mkdir()
    if summary is not None:
        (tmp_path / "run" / "summary.json").write_text(summary)
    names = {"RUN": str(tmp_path / "run"), "MISSING": str(tmp_path / "missing")}
    value = [names.get(v, v) for v in value] if isinstance(value, list) else names.get(value, value)
    with pytest.raises(LauncherError, match=re.escape(expected)) as err:
        check_calibrate(value)
    assert "\n" not in str(err.value)


def test_calibrate_out_that_cannot_be_written_is_refused_before_the_fit(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{}")
    (tmp_path / "afile").write_text("a file")
    cfg = make_config()
    with pytest.raises(LauncherError, match="plan.calibrate_out: cannot create the directory .*afile/hardware"):
        calibrate(str(tmp_path / "run"), cfg.hardware, str(tmp_path / "afile"), cfg.cache_dir, "table")
