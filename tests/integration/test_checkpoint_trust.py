"""Checkpoints from untrusted or damaged disks: no code runs, a damaged newest checkpoint falls back with
one line, none readable stops before training (exit 2) with every checkpoint kept."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from launcher.compat.dcp_compat import TORCH_SAVE_MAGIC, dcp_storage_items
from launcher.errors import LauncherError
from launcher.train.export import export
from launcher.train.loop import train
from launcher.train.untrusted import read_metadata
from tests.conftest import run_cli, run_for, tiny_args, tiny_config
from tests.unit.test_checkpoint import losses

pytestmark = pytest.mark.slow


class CreatesFile:
    """Unpickling this creates `path`: what a crafted checkpoint file would do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def plant(file: Path, marker: Path) -> None:
    """Replace `file` by the crafted pickle, padded to the original size (so no size check catches it)."""
    payload = pickle.dumps(CreatesFile(marker))
    file.write_bytes(payload + b"\0" * max(file.stat().st_size - len(payload), 0))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 8-step run with checkpoints at steps 4 and 8."""
    tmp = tmp_path_factory.mktemp("trust")
    train(run_for(tiny_config(tmp, "steps=8", "checkpoint.every=4")), tmp / "run")
    return tmp / "run"


def copy_run(reference: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "metrics.jsonl").unlink()
    return run


FILES = {"metadata": ".metadata", "shard": "__0_0.distcp", "rng": "rng_rank0.pt", "extras": "extras.json"}


@pytest.mark.parametrize("kind", FILES)
def test_crafted_file_in_newest_runs_nothing_and_falls_back_exactly(
    kind: str, reference: Path, tmp_path: Path, capsys
) -> None:
    run, marker = copy_run(reference, tmp_path), tmp_path / "pwned"
    plant(run / "checkpoints" / "step_00000008" / FILES[kind], marker)
    capsys.readouterr()
    train(run_for(tiny_config(tmp_path, "steps=8", "checkpoint.every=0")), run)
    out = capsys.readouterr().out
    assert not marker.exists(), "unpickling the checkpoint ran code"
    warnings = [line for line in out.splitlines() if "unreadable" in line]
    assert len(warnings) == 1 and "step_00000008" in warnings[0] and "Traceback" not in out, out
    assert FILES[kind] in warnings[0]  # the file is named
    expected = losses(reference)
    assert losses(run) == {s: expected[s] for s in range(5, 9)}  # resumed from step 4, exactly

    exported = tmp_path / "model.safetensors"
    assert export(str(run / "checkpoints"), str(exported)) == exported  # falls back to step 4 too
    assert not marker.exists()


def test_no_readable_checkpoint_stops_with_exit_2_and_keeps_them(reference: Path, tmp_path: Path) -> None:
    run, marker = copy_run(reference, tmp_path), tmp_path / "pwned"
    plant(run / "checkpoints" / "step_00000008" / ".metadata", marker)
    plant(run / "checkpoints" / "step_00000004" / "rng_rank0.pt", marker)
    before = sorted(str(p.relative_to(run)) for p in (run / "checkpoints").rglob("*"))
    result = run_cli("train", *tiny_args(tmp_path / "cache", steps=12), f"run_dir={run}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: no readable checkpoint under {run / 'checkpoints'} (2 found, newest ")
    assert "unexpected object builtins.exec in .metadata" in result.stderr and "a new run_dir" in result.stderr
    assert sorted(str(p.relative_to(run)) for p in (run / "checkpoints").rglob("*")) == before
    assert not (run / "metrics.jsonl").exists() and not marker.exists()

    result = run_cli("export-weights", str(run / "checkpoints"), str(tmp_path / "m.safetensors"), cwd=tmp_path)
    assert result.returncode == 2 and "no readable checkpoint" in result.stderr.splitlines()[-1]
    assert not marker.exists() and not (tmp_path / "m.safetensors").exists()


def test_damaged_checkpoint_is_kept_until_a_newer_one_is_saved(reference: Path, tmp_path: Path) -> None:
    run = copy_run(reference, tmp_path)
    damaged = run / "checkpoints" / "step_00000008"
    (damaged / "extras.json").write_text("{")
    train(run_for(tiny_config(tmp_path, "steps=7", "checkpoint.every=2", "checkpoint.keep=1")), run)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000007", "step_00000008"], names  # 4 and 6 pruned; the damaged 8 is newer: kept
    assert (damaged / "extras.json").read_text() == "{"


def test_explicit_unreadable_path_is_one_line(reference: Path, tmp_path: Path) -> None:
    run = copy_run(reference, tmp_path)
    (run / "checkpoints" / "step_00000004" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(LauncherError, match=r"__0_0.distcp: truncated \(0 of \d+ bytes\)"):
        train(run_for(tiny_config(tmp_path, "steps=8", f"resume={run / 'checkpoints' / 'step_00000004'}")), run)


def test_file_damaged_for_one_rank_makes_every_rank_fall_back(tmp_path: Path) -> None:
    from tests.integration.test_reshard import run as run_layout

    full = run_layout(tmp_path, "full", "tp=2", "checkpoint.every=3")
    (full / "checkpoints" / "step_00000006" / "rng_rank1.pt").write_bytes(b"garbage")
    expected = losses(full)
    (full / "metrics.jsonl").unlink()
    run_layout(tmp_path, "full", "tp=2", "checkpoint.every=0")  # resumes in place
    assert losses(full) == {s: expected[s] for s in range(4, 7)}
    assert "rng_rank1.pt: UnpicklingError" in (full / "rank0.log").read_text()


def test_workers_finding_no_readable_checkpoint_exit_2_in_one_line(tmp_path: Path) -> None:
    """Shards damaged past each record's first bytes pass the launcher's checks; the workers find them
    unreadable, and the run stops as the launcher would have."""
    args = [*tiny_args(tmp_path / "cache", steps=4), "tp=2", f"run_dir={tmp_path / 'run'}"]
    assert run_cli("train", *args, "checkpoint.every=2", cwd=tmp_path).returncode == 0
    for checkpoint in (tmp_path / "run" / "checkpoints").iterdir():
        for name, items in dcp_storage_items(read_metadata(checkpoint)).items():
            data = bytearray(len((checkpoint / name).read_bytes()))  # zeroed but each record's magic
            for offset, _ in items:
                data[offset : offset + len(TORCH_SAVE_MAGIC)] = TORCH_SAVE_MAGIC
            (checkpoint / name).write_bytes(bytes(data))
    result = run_cli("train", *args[:-1], "steps=6", args[-1], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no readable checkpoint under") and "(2 found, newest step_00000004: " in last
    assert "Traceback" not in result.stderr, result.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
