"""`ft`: replica groups on torchft (docs/fault-tolerance.md). Bad input is refused in one line before
anything starts; with every group alive, a run of 2 groups x 1 rank has the losses of the same run
without `ft` (one DDP layout of 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.errors import LauncherError
from launcher.extras import installed
from launcher.ft_config import FtConfig, check_ft
from launcher.spawn import launch
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
