"""Bad input met outside the config checks, through the real CLI: the launching
environment's rank variables, Hugging Face folders and exports, infinities, a degree of 0 met before
its own check, a planner-only profile, pipeline keys without a pipeline. Each: exit 2, one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.train.export import export
from launcher.train.loop import train
from tests.conftest import assert_bad_input, run_cli, run_for, tiny_args, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny` run's checkpoints and their Hugging Face export (`hf/`)."""
    tmp = tmp_path_factory.mktemp("tiny")
    train(run_for(tiny_config(tmp, "steps=2", "checkpoint.every=2")), tmp / "run")
    export(str(tmp / "run" / "checkpoints"), str(tmp / "hf"), "hf")
    return tmp


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' from the environment is not an integer >= 0"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2, WORLD_SIZE=2 and LOCAL_RANK=0 from the environment do not fit"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not: a rank needs both"),
        ({"SLURM_NTASKS": "two", "SLURM_PROCID": "0"}, "SLURM_NTASKS='two' from the environment is not an integer"),
    ],
)
def test_garbage_or_inconsistent_rank_variables(env: dict[str, str], expected: str, tmp_path: Path) -> None:
    result = run_cli("train", *tiny_args(tmp_path / "cache"), f"run_dir={tmp_path / 'run'}", env=env, cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["optim.lr=inf"], "optim.lr=inf is not a finite number: use a value > 0"),
        (["model.moe.experts=4", "ep=0"], "ep=0: expected a positive integer or auto"),
        (["hardware=tpu_v5p", "hardware.devices_per_node=1"], "hardware=tpu_v5p is a planner-only profile"),
        (["pp_schedule=zbv"], "pp_schedule=zbv schedules pipeline stages, and pp=1 has none: set pp=2 or more"),
        (["virtual_stages=2", "pp_schedule=interleaved_1f1b"], "pp_schedule=interleaved_1f1b schedules pipeline"),
    ],
)
def test_config_classes(args: list[str], expected: str, tmp_path: Path) -> None:
    result = run_cli("train", *tiny_args(tmp_path / "cache"), *args, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)


def test_hf_config_json_with_a_wrong_type(tiny_run: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    for f in (tiny_run / "hf").iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((tiny_run / "hf" / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": "1e-5"}))
    result = run_cli("train", *tiny_args(tmp_path / "cache"), f"init.from={folder}", cwd=tmp_path)
    assert_bad_input(result, "config.json has rms_norm_eps='1e-5', not a JSON int or float: fix config.json", tmp_path)


def test_a_mixture_of_experts_has_no_llama_counterpart(tiny_run: Path, tmp_path: Path) -> None:
    args = [*tiny_args(tmp_path / "cache"), "model.moe.experts=4", f"init.from={tiny_run / 'hf'}"]
    assert_bad_input(run_cli("train", *args, cwd=tmp_path), "init.from needs a dense Llama-style model", tmp_path)
    result = run_cli("export-weights", str(tiny_run / "run" / "checkpoints"), "out", "format=hf", "model=moe_tiny")
    assert_bad_input(result, "export-weights format=hf needs a dense Llama-style model", tmp_path)
    assert not (Path.cwd() / "out").exists()


def test_export_with_another_models_shapes_writes_nothing(tiny_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run_cli("export-weights", str(tiny_run / "run" / "checkpoints"), str(out), "format=hf", "model=small")
    assert_bad_input(
        result, "holds tok_embeddings.weight with shape (256, 64) but model 'small' has (256, 256)", tmp_path
    )
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_export_to_a_destination_that_cannot_be_written(tiny_run: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    result = run_cli("export-weights", str(tiny_run / "run" / "checkpoints"), str(tmp_path / "file" / "m.safetensors"))
    assert_bad_input(
        result, f"cannot write {tmp_path / 'file' / 'm.safetensors'}: {tmp_path / 'file'} is not a folder", tmp_path
    )
    result = run_cli("export-weights", str(tiny_run / "run" / "checkpoints"), str(tmp_path))
    assert_bad_input(result, f"export-weights: {tmp_path} is a folder: give a file name", tmp_path)
