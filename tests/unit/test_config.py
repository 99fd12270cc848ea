"""Composition of the `train` config and the one-line errors for bad input."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from launcher.config.validate import validate
from launcher.errors import LauncherError
from launcher.planner import resolve
from tests.conftest import assert_bad_input, make_config, run_cli


def test_default_is_small_model_on_stdlib_cpu() -> None:
    cfg = make_config()
    assert (cfg.model.name, cfg.data.name, cfg.hardware.name) == ("small", "stdlib", "cpu")
    assert cfg.batch == {"micro": 8, "global": None}


def test_the_default_model_is_conf_model_small_field_for_field() -> None:
    """One `small`: `train` and `train +model=small` build the same model, so either loads the other's checkpoint."""
    assert asdict(make_config().model) == asdict(make_config("+model=small").model)


def test_plus_model_8b_with_tp_composes() -> None:
    cfg = make_config("+model=8b", "tp=8", "hardware=h100_sxm")
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_kv_heads, cfg.model.ffn_dim) == (4096, 32, 8, 14336)
    assert cfg.tp == 8 and cfg.hardware.peak_tflops == 989.0
    assert [link.name for link in cfg.hardware.links] == ["nvlink4", "infiniband_ndr"]


def test_overrides_reach_the_schema() -> None:
    cfg = make_config("steps=200", "+model=small", "optim.lr=1e-3", "batch.micro=8", "seq_len=256", "batch.global=32")
    assert (cfg.steps, cfg.optim.lr, cfg.batch["global"], cfg.seq_len) == (200, 1e-3, 32, 256)


@pytest.mark.parametrize("name", ["tiny", "small", "125m", "1b", "8b", "70b", "405b", "gpt2-8.3b"])
def test_every_model_composes_and_validates(name: str) -> None:
    cfg = make_config(f"+model={name}", "seq_len=128")
    validate(cfg)
    assert cfg.model.name == name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["seq_len=4096"], "seq_len=4096 exceeds model.max_seq_len=1024"),
        (["batch.global=12"], "batch.global=12 is not a multiple of batch.micro x dp = 8 x 1"),
        (["model.norm=batchnorm"], "model.norm=batchnorm: choose one of rmsnorm, layernorm"),
        (["cpu_allocator=small"], "cpu_allocator=small: choose one of auto, fast, lean"),
        (["model.n_heads=7"], "model.dim=256 is not divisible by model.n_heads=7"),
        (["batch.micro=0"], "batch.micro=0 is out of range: use an integer >= 1 or auto"),
    ],
)
def test_validate_names_key_and_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(LauncherError, match=message.replace(".", r"\.").replace("(", r"\(")):
        resolve(make_config(*overrides))  # the config checks and the layout rules `train` applies


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["stpes=10"], "unknown config key 'stpes': did you mean 'steps'?"),
        (["steps=ten"], "steps=ten: expected a value of type Integer"),
        (["dry_run=maybe"], "dry_run=maybe: expected a value of type Boolean"),
        (["hardware=h300"], "available hardware: a100"),
        (["+model=9b"], "Could not find 'model/9b'"),
        (["data=tokens"], "data.path is missing"),
        (["data=tokens", "data.path=/nonexistent/train.bin"], "data.path=/nonexistent/train.bin: no such file"),
        (["seq_len=4096"], "seq_len=4096 exceeds model.max_seq_len"),
        (["batch.global=12"], "batch.global=12 is not a multiple"),
        (["data=tokens", "data.path=big_ids.bin"], "holds token id 999, beyond model.vocab_size=256"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], expected: str, tmp_path: Path) -> None:
    (np.arange(20_000, dtype=np.uint16) % 1000).tofile(tmp_path / "big_ids.bin")  # long enough to validate on
    assert_bad_input(run_cli("train", *args, "steps=1", cwd=tmp_path), expected, tmp_path)


@pytest.mark.slow
def test_help_and_cfg_job(tmp_path: Path) -> None:
    result = run_cli("train", "--cfg", "job", "+model=8b", "tp=8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "n_kv_heads: 8" in result.stdout and "tp: 8" in result.stdout
    result = run_cli("train", "--help", cwd=tmp_path)
    assert result.returncode == 0 and "model" in result.stdout


HELP_MUST_NAME = {  # what a newcomer needs from each command's --help
    "train": ["+model=", "hardware=", "nodes=", "tp=", "pp=", "dp=", "steps=", "batch.global=", "--cfg job", "docs/"],
    "plan": ["+model=", "hardware=", "nodes=", "seq_len=", "batch.global=", "plan.top=", "--cfg job", "docs/"],
    "export-weights": ["format=hf", "model=NAME", "examples:", "docs/"],
    "doctor": ["hardware=", "run_dir=", "compile=true", "examples:", "docs:"],
}


@pytest.mark.slow
@pytest.mark.parametrize("app", sorted(HELP_MUST_NAME))
def test_help_teaches_in_under_40_lines(app: str, tmp_path: Path) -> None:
    """--help: the app's name, the keys people set, examples and the docs, in < 40 lines at 100 columns."""
    result = run_cli(app, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith((f"{app}: ", f"usage: {app} ")), result.stdout[:200]
    assert sum(max(1, -(-len(line) // 100)) for line in result.stdout.splitlines()) < 40, result.stdout
    assert [word for word in HELP_MUST_NAME[app] if word not in result.stdout] == []
    assert f"{app} " in result.stdout.split("xamples:")[1]  # the examples run this command


@pytest.mark.slow
def test_plan_writes_nothing(tmp_path: Path) -> None:
    result = run_cli("plan", "+model=8b", "nodes=1", "plan.top=1", cwd=tmp_path)
    assert result.returncode == 0 and "layouts fit" in result.stdout, result.stderr
    assert not list(tmp_path.iterdir())
