"""The test fault plan (launcher/train/faults.py): one parser for the five LAUNCHER_TEST_* variables, each in
its syntax; a value that does not parse is one line naming the variable and its syntax, exit 2, before any
worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.errors import LauncherError
from launcher.train.faults import (
    TEST_DISK_FULL_ENV,
    TEST_HANG_ENV,
    TEST_KILL_ENV,
    TEST_NAN_ENV,
    TEST_SPIKE_ENV,
    DiskFull,
    FaultPlan,
    Hang,
    Kill,
    Nan,
    Spike,
    fault_plan,
)
from tests.conftest import assert_bad_input, run_cli, tiny_args


def test_every_fault_in_its_syntax() -> None:
    env = {
        TEST_NAN_ENV: "3:1",
        TEST_SPIKE_ENV: "8,11",
        TEST_HANG_ENV: "5:1:sleep",
        TEST_KILL_ENV: "3:1:late",
        TEST_DISK_FULL_ENV: "4",
    }
    plan = fault_plan(env)
    assert plan == FaultPlan(
        Nan(3, 1), Spike(frozenset({8, 11})), Hang(5, 1, "sleep"), Kill(3, 1, True), DiskFull(4, 0)
    )
    assert (plan.nan_step(1), plan.nan_step(0)) == (3, None)
    assert plan.spike_batches() == {8, 11}
    assert plan.hang_of(1) == Hang(5, 1, "sleep") and plan.hang_of(0) is None
    assert plan.kill_of(1) == Kill(3, 1, True) and plan.kill_of(None) is None
    assert plan.disk_full_at(4, 0) and not plan.disk_full_at(4, 1) and not plan.disk_full_at(3, 0)


def test_defaults_and_no_plan() -> None:
    plan = fault_plan({TEST_NAN_ENV: "5", TEST_HANG_ENV: "3:1", TEST_KILL_ENV: "3:1", TEST_DISK_FULL_ENV: "4:1"})
    assert (plan.nan, plan.hang, plan.kill, plan.disk_full) == (
        Nan(5, 0),
        Hang(3, 1, "stop"),
        Kill(3, 1),
        DiskFull(4, 1),
    )
    assert fault_plan({}) == FaultPlan() and fault_plan({TEST_NAN_ENV: ""}) == FaultPlan()
    assert FaultPlan().spike_batches() == frozenset() and FaultPlan().nan_step(0) is None


@pytest.mark.parametrize(
    ("name", "value", "syntax"),
    [
        (TEST_NAN_ENV, "five", "STEP[:RANK]"),
        (TEST_NAN_ENV, "3:1:2", "STEP[:RANK]"),
        (TEST_SPIKE_ENV, "8;11", "BATCH[,BATCH...]"),
        (TEST_HANG_ENV, "3", "STEP:RANK[:stop|sleep]"),
        (TEST_HANG_ENV, "3:1:pause", "STEP:RANK[:stop|sleep]"),
        (TEST_KILL_ENV, "3:1:soon", "STEP:REPLICA[:late]"),
        (TEST_DISK_FULL_ENV, "-4", "STEP[:RANK]"),
    ],
)
def test_a_bad_plan_is_one_error_naming_the_variable(name: str, value: str, syntax: str) -> None:
    with pytest.raises(LauncherError) as err:
        fault_plan({name: value})
    assert str(err.value).startswith(f"{name}={value}: a test fault plan reads {name}={syntax}, e.g. ")
    assert str(err.value).endswith(f"fix or unset {name}")


@pytest.mark.slow
def test_the_cli_refuses_a_bad_plan_before_any_worker(tmp_path: Path) -> None:
    result = run_cli("train", *tiny_args(tmp_path / "cache"), env={TEST_HANG_ENV: "3"}, cwd=tmp_path)
    assert_bad_input(
        result, f"{TEST_HANG_ENV}=3: a test fault plan reads {TEST_HANG_ENV}=STEP:RANK[:stop|sleep]", tmp_path
    )
