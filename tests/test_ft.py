"""`ft`: replica groups on torchft (docs/fault-tolerance.md). Bad input is refused in one line before
anything starts; with every group alive, a run of 2 groups x 1 rank has the losses of the same run
without `ft` (one DDP layout of 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher.errors import LauncherError
from launcher.extras import installed
from launcher.ft_config import FtConfig, check_ft
from launcher.spawn import launch
from launcher.train.checkpoint import complete_checkpoints
from launcher.train.replicas import TEST_KILL_ENV
from tests.conftest import losses, run_for, tiny_config


def test_ft_off_by_default_and_at_one_replica() -> None:
    assert not FtConfig().on
    assert not FtConfig(replicas=1).on
    check_ft(FtConfig(replicas=1, min_replicas=5), 3)  # off: nothing to check


@pytest.mark.parametrize(
    ("ft", "dp_replicate", "message"),
    [
        (FtConfig(replicas=2), 3, "ft.replicas=2: does not divide dp_replicate=3"),
        (FtConfig(replicas=2, min_replicas=3), 2, "ft.min_replicas=3: more than ft.replicas=2"),
    ],
)
def test_bad_ft_is_one_line(ft: FtConfig, dp_replicate: int, message: str) -> None:
    with pytest.raises(LauncherError, match=message) as err:
        check_ft(ft, dp_replicate)
    assert "\n" not in str(err.value)


def test_ft_without_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("launcher.extras.installed", lambda module: module != "torchft")
    with pytest.raises(LauncherError, match=r"ft.replicas=2 needs the torchft package: pip install 'launcher\[ft\]'"):
        check_ft(FtConfig(replicas=2), 2)


needs_torchft = pytest.mark.skipif(not installed("torchft"), reason="the ft extra (torchft) is not installed")
LAYOUT = ("dp=2", "dp_replicate=2", "dp_shard=1", "steps=4", "checkpoint.every=0")


@needs_torchft
@pytest.mark.slow
def test_two_groups_train_as_one_layout(tmp_path: Path) -> None:
    """2 groups x 1 rank (ft) against one layout of 2 DDP ranks: the same samples, the same losses."""
    plain = tmp_path / "plain"
    launch(run_for(tiny_config(tmp_path, *LAYOUT), None), plain)
    ft = tmp_path / "ft"
    cfg = tiny_config(tmp_path, *LAYOUT, "ft.replicas=2", "ft.min_replicas=2", "ft.quorum_timeout_s=30")
    summary = launch(run_for(cfg, None), ft)
    assert summary["replicas"] == 2
    expected = losses(plain)
    assert len(expected) == 4
    for run_dir in (ft, ft / "replica_1"):  # each group logs the loss averaged over both
        assert losses(run_dir) == pytest.approx(expected, rel=1e-5)
    rows = [json.loads(line) for line in (ft / "metrics.jsonl").read_text().splitlines()]
    assert [row["replicas"] for row in rows] == [2, 2, 2, 2]


def final_state(run_dir: Path) -> dict[str, Any]:
    """The newest complete checkpoint under `run_dir`, as one plain state dict (DCP read without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(complete_checkpoints(run_dir / "checkpoints")[0], run_dir / "final.pt")
    return torch.load(run_dir / "final.pt", weights_only=False)


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """Bitwise equal, through nested dicts and lists."""
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, list | tuple):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where


@needs_torchft
@pytest.mark.slow
def test_killed_group_restarts_and_heals_from_its_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 1's worker dies at step 3 (SIGKILL, first life only): group 0 steps on alone, group 1's agent
    restarts it, it takes group 0's state in a quorum and ends bitwise equal to it."""
    monkeypatch.setenv(TEST_KILL_ENV, "3:1")
    steps, timeout_s = 400, 20.0
    overrides = (f"steps={steps}", f"checkpoint.every={steps}", "max_restarts=1", "metrics.log_every=1")
    # the survivor stalls while the dead group still counts as alive (6 s): group 1's restart is under way
    # then, and it must be back before the survivor's last step
    ft = ("ft.replicas=2", "ft.min_replicas=1", f"ft.quorum_timeout_s={timeout_s}", "ft.heartbeat_timeout_s=6")
    summary = launch(run_for(tiny_config(tmp_path, *LAYOUT, *overrides, *ft), None), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))  # each once: the survivor never restarted
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)]
    assert max(gaps) < timeout_s
    alone = [row["step"] for row in rows if row["replicas"] == 1]
    assert alone[0] == 3 and rows[-1]["replicas"] == 2  # alone from the kill until group 1 healed
    assert alone == list(range(3, alone[-1] + 1))
    assert summary["ft_short_steps"] == alone
    assert summary["ft_tokens_missed"] == len(alone) * 4 * 32  # group 1's batch of each (4 sequences of 32)
    ours, theirs = final_state(tmp_path / "run"), final_state(tmp_path / "run" / "replica_1")
    assert_same(ours, theirs)


SIX = (*LAYOUT, "steps=6", "checkpoint.every=4")
FT = ("ft.replicas=2", "ft.min_replicas=2", "ft.quorum_timeout_s=30")


@pytest.fixture(scope="module")
def ft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 groups x 1 rank, 6 steps, checkpoints at steps 4 and 6."""
    tmp = tmp_path_factory.mktemp("ft_run")
    launch(run_for(tiny_config(tmp, *SIX, *FT), None), tmp / "run")
    return tmp / "run"


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("ft", [(), FT], ids=["ft_off", "ft_on"])
def test_a_checkpoint_of_two_groups_resumes_the_whole_job(ft_run: Path, ft: tuple[str, ...], tmp_path: Path) -> None:
    """Group 0's checkpoint at step 4 of 6 is the whole job's: resumed without ft (one layout of 2 DDP
    ranks) or with ft (each group loads it), steps 5 and 6 have the ft run's losses."""
    expected = losses(ft_run)
    step4 = ft_run / "checkpoints" / "step_00000004"
    summary = launch(run_for(tiny_config(tmp_path, *SIX, f"resume={step4}", *ft), None), tmp_path / "run")
    assert summary["steps"] == 6
    assert losses(tmp_path / "run") == pytest.approx({5: expected[5], 6: expected[6]}, rel=1e-5)


@needs_torchft
@pytest.mark.slow
def test_a_group_back_after_the_run_ended_trains_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Group 1 dies at step 3 of 30; group 0 steps on alone and finishes before group 1's agent has it back
    (a restart takes seconds). The restarted group finds the run ended: it trains nothing, and `train`
    returns without waiting for it to train the run alone. The death is two lines on the terminal (the
    agent's and the survivor's), no tracebacks."""
    monkeypatch.setenv(TEST_KILL_ENV, "3:1")
    overrides = ("steps=30", "checkpoint.every=30", "max_restarts=1", "metrics.log_every=1")
    ft = ("ft.replicas=2", "ft.min_replicas=1", "ft.quorum_timeout_s=60", "ft.heartbeat_timeout_s=1")
    summary = launch(run_for(tiny_config(tmp_path, *LAYOUT, *overrides, *ft), None), tmp_path / "run")
    assert summary["steps"] == 30 and summary["ft_short_steps"] == list(range(3, 31))
    assert [row["step"] for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())] == list(range(1, 31))
    # group 1: its first life's two steps, then nothing (its second life found the run ended)
    assert list(losses(tmp_path / "run" / "replica_1")) == [1, 2]
    err = capfd.readouterr().err
    assert "failed (exitcode: -9)" in err and "got exception waiting for work" in err
    assert "Traceback" not in err and "flight recorder" not in err, err
