"""Bad input met outside the config checks, through the real CLI: the launching
environment's rank variables (half set too), Hugging Face folders and exports, infinities and limits no
healthy run meets, a degree of 0 met before its own check, a planner-only profile, a feature's keys
without the feature, another run's checkpoints or mixture, malformed YAML, options the commands would
ignore, Hydra's usage errors (issue 42, item 10's classes a-i). Each: exit 2, one line."""

from __future__ import annotations

import json
import shutil
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


@pytest.mark.parametrize(
    "args",
    [
        ["ft.quorum_timeout_s=5"],
        ["data.sources=[{name: stdlib, weight: 1}]"],
        ["fp8.recipe=rowwise", "dtype=fp32"],
        ["slurm.partition=gpu"],
        ["model.moe.top_k=1"],
        ["smoke=true"],
        ["data.path=train.bin"],
        ["sweep.top=2"],
    ],
)
def test_a_features_keys_without_its_switch(args: list[str], tmp_path: Path) -> None:
    """Class a: a key only a feature reads, given while that feature is off, is refused naming the switch."""
    result = run_cli("train", *tiny_args(tmp_path / "cache"), *args, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    key = args[0].split("=")[0]
    assert_bad_input(result, f"{args[0].split('=')[0]}=", tmp_path)
    assert "is read only with" in result.stderr and f"or drop {key}" in result.stderr


@pytest.mark.parametrize("how", ["resume=never", "checkpoint.dir", "resume=PATH"])
def test_never_overwrites_another_runs_checkpoints(how: str, tiny_run: Path, tmp_path: Path) -> None:
    """Class c: a folder holding checkpoints is only continued, never started over in (nor pruned)."""
    theirs = tmp_path / "theirs"
    shutil.copytree(tiny_run / "run", theirs)
    (theirs / "metrics.jsonl").unlink()  # so that assert_bad_input sees whether this run's worker started
    before = sorted(str(p.relative_to(theirs)) for p in (theirs / "checkpoints").rglob("*"))
    where = {
        "resume=never": [f"run_dir={theirs}", "resume=never"],
        "checkpoint.dir": [f"run_dir={tmp_path / 'mine'}", f"checkpoint.dir={theirs / 'checkpoints'}", "resume=never"],
        "resume=PATH": [f"run_dir={theirs}", f"resume={tiny_run / 'run' / 'checkpoints'}"],
    }[how]
    result = run_cli("train", *tiny_args(tmp_path / "cache"), "checkpoint.every=1", *where, cwd=tmp_path)
    assert_bad_input(
        result, f"{theirs / 'checkpoints'} holds checkpoints this run did not write (newest step_00000002)", tmp_path
    )
    assert "resume=auto continues them; a new run_dir (or checkpoint.dir) starts over" in result.stderr
    assert sorted(str(p.relative_to(theirs)) for p in (theirs / "checkpoints").rglob("*")) == before


MIX = "data.sources=[{name: stdlib, weight: 1, label: a}, {name: stdlib, weight: 3, label: b}]"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["data=mix", "data.sources=[{name: stdlib, weight: 3, label: b}, {name: stdlib, weight: 1, label: a}]"],
            "data.sources: the checkpoint mixes ['a', 'b'] in this order, this run ['b', 'a']",
        ),
        ([], "the checkpoint was written by data=mix (sources a, b): resume it with data=mix"),
    ],
)
def test_a_mixture_resumed_with_other_sources(args: list[str], expected: str, tmp_path: Path) -> None:
    """Class b: reordered sources (each source's count would go to another) or no mixture at all: one line,
    exit 2, the checkpoints kept."""
    run_dir = tmp_path / "run"
    train(run_for(tiny_config(tmp_path, "steps=2", "checkpoint.every=2", "data=mix", MIX)), run_dir)
    before = sorted(str(p) for p in (run_dir / "checkpoints").rglob("*"))
    metrics = (run_dir / "metrics.jsonl").read_text()
    result = run_cli("train", *tiny_args(tmp_path / "cache", steps=4), *args, f"run_dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and expected in line and "Traceback" not in result.stderr
    assert sorted(str(p) for p in (run_dir / "checkpoints").rglob("*")) == before
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # refused before any worker (which opens it)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK is set but RANK is not: a rank needs both RANK and WORLD_SIZE"),
        ({"SLURM_PROCID": "1"}, "SLURM_PROCID=1 is set but SLURM_NTASKS is not: a task needs both"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "1"}, "SLURM_PROCID=1, SLURM_NTASKS=1 and SLURM_LOCALID=0 from the"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "RANK and WORLD_SIZE are set but MASTER_PORT is not"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}, "export MASTER_PORT=29500"),
    ],
)
def test_half_set_rank_variables(env: dict[str, str], expected: str, tmp_path: Path) -> None:
    """Class e: one launcher's variables without the rest."""
    result = run_cli("train", *tiny_args(tmp_path / "cache"), f"run_dir={tmp_path / 'run'}", env=env, cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)


@pytest.mark.parametrize(
    ("app", "file", "text", "expected"),
    [
        ("train", "model/bad.yaml", "name: bad\ndim: [64\n", "bad.yaml, line 3, column 1: expected ',' or ']'"),
        ("plan", "model/bad.yaml", "name: bad\ndim: [64\n", "bad.yaml, line 3, column 1: expected ',' or ']'"),
        ("train", "hardware/hx.yaml", "name: hx\n  kind: cpu\n", "hx.yaml, line 2, column 7: mapping values"),
        ("train", "model/bad.yaml", "name: bad\ndim: sixty\n", "model.dim=sixty: expected a value of type Integer"),
    ],
)
def test_malformed_yaml_in_a_config_dir(app: str, file: str, text: str, expected: str, tmp_path: Path) -> None:
    """Class f: a user's --config-dir file that is not YAML, or holds a wrong type."""
    (tmp_path / "conf" / file).parent.mkdir(parents=True)
    (tmp_path / "conf" / file).write_text(text)
    choice = f"{Path(file).parent}={Path(file).stem}"  # model=: overrides tiny_args' +model=tiny
    result = run_cli(app, f"--config-dir={tmp_path / 'conf'}", *tiny_args(tmp_path / "cache"), choice, cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["watchdog.timeout_s=0.001"], "watchdog.timeout_s=0.001 would stop a healthy run as hung"),
        (["nccl_timeout_s=1"], "nccl_timeout_s=1 would fail a healthy run"),
        (["optim.lr=1e300"], "optim.lr=1e+300 is out of range: use a value > 0 and <= 1"),
        (["optim.grad_clip=nan"], "optim.grad_clip=nan is out of range"),
        (["steps=1000000000000"], "steps=1000000000000 is out of range: use an integer >= 0 and <= 1000000000"),
    ],
)
def test_numeric_edges(args: list[str], expected: str, tmp_path: Path) -> None:
    """Class g: values no healthy run meets (a timeout it cannot keep, a step that diverges at once)."""
    result = run_cli("train", *tiny_args(tmp_path / "cache"), *args, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["doctor", "--foo"], "doctor: unrecognized arguments: --foo (flags first"),
        (["doctor", "hardware"], "doctor: hardware needs a value: use hardware=, run_dir="),
        (["doctor", "run_dir="], "doctor: run_dir needs a value"),
        (["doctor", "hardwre=h200"], "doctor: unknown option 'hardwre': use hardware="),
        (["doctor", "hardware=cpu", "hardware=a100"], "doctor: hardware given twice"),
        (["doctor", "compile=maybe"], "doctor: compile=maybe: choose one of true, false, auto"),
        (["export-weights", "CKPT", "o.safetensors", "--foo"], "export-weights: unrecognized arguments: --foo"),
        (["export-weights", "CKPT", "o.safetensors", "shard_gib=2"], "shard_gib splits format=hf's weight files"),
        (["export-weights", "CKPT", "out", "format=hf", "shard_gib=inf"], "shard_gib=inf: give a positive number"),
        (["export-weights", "CKPT", "out", "format=hf", "format=safetensors"], "export-weights: format given twice"),
    ],
)
def test_doctor_and_export_ignore_nothing(args: list[str], expected: str, tiny_run: Path, tmp_path: Path) -> None:
    """Class h: an option these commands would drop or take half of is refused in one line."""
    args = [str(tiny_run / "run" / "checkpoints") if a == "CKPT" else a for a in args]
    assert_bad_input(run_cli(*args, cwd=tmp_path), expected, tmp_path)
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "steps=2", "-m", "run_dir=x"], "train: unrecognized arguments: run_dir=x (flags first, then KEY"),
        (["train", "--foo"], "train: unrecognized arguments: --foo"),
        (["train", "steps=2", "--cfg"], "train: argument --cfg/-c: expected one argument"),
        (["plan", "+model=tiny", "--foo"], "plan: unrecognized arguments: --foo"),
    ],
)
def test_hydra_usage_errors_are_one_line(args: list[str], expected: str, tmp_path: Path) -> None:
    """Class i: Hydra's own argument parser (a flag after the overrides, an unknown flag)."""
    assert_bad_input(run_cli(*args, cwd=tmp_path), expected, tmp_path)
