"""dtype=fp8's bad input: a profile without float8 units, a layer the shape filter converts whose
dims float8 GEMMs cannot take, an unknown recipe, torchao not installed. Each is one line before any
worker starts (in-process through `train_task`, and once through the CLI: exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config import extras
from launcher.errors import LauncherError
from launcher.launch.cli import train_task
from tests.conftest import assert_bad_input, make_config, run_cli, tiny_args

CASES = [
    (["dtype=fp8"], "dtype=fp8: hardware profile cpu has no FP8 units (peak_tflops_fp8 is null)"),
    (["dtype=fp8", "hardware=a100"], "dtype=fp8: hardware profile a100 has no FP8 units"),
    (["dtype=fp8", "hardware=v100_dgx2"], "dtype=fp8: hardware profile v100_dgx2 has no FP8 units"),
    (["dtype=fp8", "hardware=tpu_v5p"], "dtype=fp8: hardware profile tpu_v5p has no FP8 units"),
    (["dtype=fp8", "fp8.emulate=true", "fp8.recipe=delayed"], "fp8.recipe=delayed: choose one of tensorwise"),
    (
        ["dtype=fp8", "fp8.emulate=true", "fp8.min_features=16", "model.ffn_dim=180"],
        "fp8.min_features=16 converts feed_forward.w1 (64 -> 180 features) and float8 matmuls need multiples of 16",
    ),
    (
        ["dtype=fp8", "fp8.emulate=true", "seq_len=100", "batch.micro=1"],
        "dtype=fp8: a micro-batch holds 100 tokens a rank (batch.micro=1 x seq_len=100) and float8 weight "
        "gradients need a multiple of 16: use seq_len=112, or a batch.micro that makes one",
    ),
    (
        ["dtype=fp8", "fp8.emulate=true", "seq_len=72", "batch.micro=auto"],
        "dtype=fp8: a micro-batch holds 72 tokens a rank (batch.micro=auto x seq_len=72)",
    ),
]


@pytest.mark.parametrize(("args", "expected"), CASES)
def test_fp8_bad_input_is_one_line(args: list[str], expected: str, tmp_path: Path) -> None:
    cfg = make_config(*tiny_args(tmp_path / "cache"), f"run_dir={tmp_path / 'run'}", *args)
    with pytest.raises(LauncherError) as err:
        train_task(cfg)
    assert "\n" not in str(err.value) and expected in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists(), "nothing may start on bad input"


def test_a_layer_below_the_filter_may_have_any_shape(tmp_path: Path) -> None:
    """ffn_dim=180 stays high precision under the default filter: no error, nothing to convert."""
    from launcher.config.validate import validate

    validate(make_config(*tiny_args(tmp_path / "cache"), "dtype=fp8", "fp8.emulate=true", "model.ffn_dim=180"))


def test_fp8_without_torchao_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "installed", lambda module: module != "torchao")
    cfg = make_config(*tiny_args(tmp_path / "cache"), f"run_dir={tmp_path / 'run'}", "dtype=fp8", "fp8.emulate=true")
    with pytest.raises(LauncherError, match=r"dtype=fp8 needs the torchao package: pip install 'launcher\[fp8\]'"):
        train_task(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fp8_on_a_profile_without_fp8_units_through_the_cli(tmp_path: Path) -> None:
    result = run_cli("train", *tiny_args(tmp_path / "cache"), "dtype=fp8", "hardware=a100", cwd=tmp_path)
    assert_bad_input(result, "hardware profile a100 has no FP8 units", tmp_path)
