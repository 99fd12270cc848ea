"""`plan.tokens` and `plan.compare` (launcher/planner/budget.py): days, device-hours and cost follow from
step time x steps; the checkpoint interval is Young-Daly's closed form; failures only ever cost time."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path

import pytest

from bench.published_runs import make_cfg
from launcher import planner
from launcher.config.ft import FtConfig
from launcher.config.hardware import load_profile, profile_names
from launcher.config.layout_keys import from_config
from launcher.config.validate import validate
from launcher.errors import LauncherError
from launcher.planner.budget import DAY, HOUR, budget, compared_nodes, ft_budget, peer_bandwidth
from launcher.planner.failures import ReplicaFt, goodput, groups, prefer_ft, replica_ft, stop_mtbf, young_daly_interval
from launcher.planner.predict import predict
from launcher.planner.report import to_json
from launcher.planner.request import problem
from tests.conftest import run_cli

H100 = load_profile("h100_sxm")


@pytest.fixture(scope="module")
def pred() -> planner.Prediction:
    """8b on one H100 node, tp=8: a prediction as `plan` makes it."""
    cfg = make_cfg("8b", "h100_sxm", tp=8, seq_len=2048, batch={"micro": 1, "global": 16})
    return predict(problem(cfg, 8), from_config(cfg, 8))


def test_days_device_hours_and_cost_follow_from_step_time_times_steps(pred) -> None:
    tokens = 100_000.5 * pred.tokens_per_step  # half a step more: a whole step more
    b = budget(pred, tokens, H100)
    assert b.steps == 100_001
    assert b.ideal_s == pytest.approx(100_001 * pred.step_time_s)
    assert b.days * DAY * b.goodput == pytest.approx(b.ideal_s)
    assert b.device_hours == pytest.approx(b.days * 24 * 8)
    assert b.cost == pytest.approx(b.device_hours * 2.99)
    assert 0.99 < b.goodput < 1  # one node: failures are rare, yet cost something


def test_the_checkpoint_interval_is_young_dalys_closed_form(pred) -> None:
    hw = dataclasses.replace(H100, storage_gbs=0.5, device_mtbf_hours=1000.0, restart_s=300.0)
    b = budget(pred, 1e12, hw)
    save = pred.memory.checkpoint / 0.5e9
    mtbf = 1000.0 * HOUR / 8
    assert b.save_s == pytest.approx(save) and b.mtbf_s == pytest.approx(mtbf)
    assert b.interval_s == pytest.approx(math.sqrt(2 * save * mtbf))
    assert young_daly_interval(2.0, 100.0) == pytest.approx(20.0)
    assert b.checkpoint_every == round(b.interval_s / pred.step_time_s)

    def overhead(tau: float) -> float:  # the first-order loss the interval minimises
        return save / tau + tau / (2 * mtbf)

    assert overhead(b.interval_s) < min(overhead(b.interval_s * 0.9), overhead(b.interval_s * 1.1))
    # goodput at the recommended whole steps, Daly's first-order model
    tau = b.checkpoint_every * pred.step_time_s
    assert b.goodput == pytest.approx(tau / (tau + save) * (1 - (300 + (tau + save) / 2) / mtbf))


def test_goodput_falls_as_failures_rise_and_is_zero_when_they_outpace_restarts(pred) -> None:
    rates = [1e6, 1e5, 1e4, 1e3, 1e2]  # device MTBF, hours: ever more failures
    budgets = [budget(pred, 1e12, dataclasses.replace(H100, device_mtbf_hours=m)) for m in rates]
    goodputs = [b.goodput for b in budgets]
    assert goodputs == sorted(goodputs, reverse=True) and len(set(goodputs)) == len(goodputs)
    assert [b.days for b in budgets] == sorted(b.days for b in budgets)
    assert goodput(100.0, 10.0, 60.0, 10_000.0) == pytest.approx(100 / 110 * (1 - 115 / 10_000))
    never = budget(pred, 1e12, dataclasses.replace(H100, device_mtbf_hours=0.1, restart_s=600.0))
    assert never.goodput == 0 and never.days == math.inf
    assert never.as_dict()["days"] is None and never.as_dict()["cost_usd"] is None  # JSON has no infinity


def test_compared_nodes_same_devices_or_same_hourly_spend() -> None:
    gb200, a100 = load_profile("gb200_nvl72"), load_profile("a100")
    assert compared_nodes(16384, gb200, None) == [4096]
    assert compared_nodes(12, H100, None) == [2]  # whole nodes, rounded up
    spend = 16 * 2.99  # two H100 nodes an hour
    assert compared_nodes(16, a100, spend) == [math.floor(spend / (1.79 * 8)), 2, 1]  # 3, then 2^a, 3 x 2^a
    assert compared_nodes(16, H100, spend) == [2, 1]
    assert compared_nodes(16384 * 8, H100, 16384 * 8 * 2.99)[:4] == [16384, 12288, 8192, 6144]


def test_the_same_budget_falls_back_to_a_count_the_batch_splits_over() -> None:
    """Three A100 nodes cost what two H100 nodes do, but 64 sequences do not split over 24 GPUs at pp=1."""
    cfg = plan_cfg(tokens=1e12, compare=["a100"], compare_at="budget")
    with pytest.raises(LauncherError, match="batch"):
        planner.plan(dataclasses.replace(cfg, hardware=load_profile("a100"), nodes=3), 24)
    (row,) = planner.compare(cfg, 16)
    assert row.nodes == 2 and row.error is None and row.budget.devices == 16


def test_every_rented_accelerator_profile_has_a_price() -> None:
    priced = {name: load_profile(name).price_per_hour for name in profile_names()}
    assert priced["cpu"] is None and priced["v100_dgx2"] is None  # not rented
    assert all(p and 0.5 < p < 20 for name, p in priced.items() if name not in ("cpu", "v100_dgx2"))


def plan_cfg(model: str = "8b", **plan: object) -> object:
    return make_cfg(model, "h100_sxm", tp="auto", seq_len=2048, batch={"micro": 1, "global": 64}, plan=plan)


def test_compare_gives_one_row_per_profile_each_its_own_best_layout() -> None:
    names = ["h100_sxm", "h200", "tpu_v5p", "v100_dgx2"]
    rows = planner.compare(plan_cfg(tokens=1e12, compare=names), 8)
    assert [r.hardware.name for r in rows] == names
    assert [r.devices for r in rows] == [8, 8, 8, 16]  # a DGX-2 node holds 16
    for row in rows:
        assert row.budget == budget(row.prediction, 1e12, row.hardware)
    own = planner.plan(plan_cfg(), 8)[1].ranked[0]
    assert rows[0].prediction.step_time_s == own.step_time_s
    assert rows[2].prediction.step_time_s != own.step_time_s
    out = io.StringIO()
    to_json([own], [rows[0].budget], rows, out)
    data = json.loads(out.getvalue())
    assert data["layouts"][0]["budget"]["checkpoint_every"] == rows[0].budget.checkpoint_every
    assert [r["hardware"] for r in data["compare"]] == names and data["compare"][1]["budget"]["days"] > 0


def test_a_profile_no_layout_fits_gets_its_line_in_the_comparison() -> None:
    cfg = make_cfg("70b", "h100_sxm", tp="auto", pp="auto", plan={"tokens": 1e12, "compare": ["h100_sxm", "b200"]})
    h100, b200 = planner.compare(cfg, 8)
    assert h100.budget is None and "model 70b fits no layout on 8 x h100_sxm" in h100.error
    assert b200.error is None and b200.budget.days > 0
    assert "error" in h100.as_dict() and "budget" in b200.as_dict()


@pytest.mark.parametrize(
    "plan, line",
    [
        ({"tokens": -1.0}, "plan.tokens=-1.0 is out of range"),
        ({"tokens": 1e12, "compare": ["h100"]}, "plan.compare: no hardware profile 'h100': choose from a100, b200"),
        ({"compare": ["h200"]}, "plan.compare costs a token budget on each profile: give plan.tokens=N"),
        ({"tokens": 1e12, "compare": ["cpu"]}, "plan.compare: the cpu profile is this machine"),
        ({"tokens": 1e12, "compare": ["v100_dgx2"], "compare_at": "budget"}, "v100_dgx2 has none: drop it"),
        ({"tokens": 1e12, "compare_at": "money"}, "plan.compare_at=money: choose one of devices, budget"),
    ],
)
def test_bad_plan_keys_are_one_line(plan: dict, line: str) -> None:
    with pytest.raises(LauncherError) as err:
        validate(plan_cfg(**plan))
    assert line in str(err.value) and "\n" not in str(err.value)


def test_bad_budget_numbers_of_a_profile_are_one_line() -> None:
    cfg = plan_cfg(tokens=1e12)
    for key, value in (("price_per_hour", 0.0), ("storage_gbs", -1.0), ("device_mtbf_hours", 0.0)):
        with pytest.raises(LauncherError, match=f"hardware.{key}=.* is out of range"):
            validate(dataclasses.replace(cfg, hardware=dataclasses.replace(H100, **{key: value})))
    own = dataclasses.replace(cfg, hardware=dataclasses.replace(H100, price_per_hour=None))
    with pytest.raises(LauncherError, match="give hardware.price_per_hour=USD"):
        validate(dataclasses.replace(own, plan=dataclasses.replace(own.plan, compare=["a100"], compare_at="budget")))


def test_the_job_stops_under_replica_ft_follow_the_closed_form() -> None:
    m, d = 10_000.0, 600.0
    assert stop_mtbf(m, 4, 4, d) == pytest.approx(m)  # no group may be down: every failure stops the job
    assert stop_mtbf(m, 2, 1, d) == pytest.approx(2 * m * m / d)  # a failure while the other group heals
    lam = 1 / (4 * m)  # 4 groups, 2 may be down: a third failure while two of the other three heal
    assert stop_mtbf(m, 4, 2, d) == pytest.approx(1 / (4 * lam * 3 * (lam * d) ** 2))
    assert stop_mtbf(m, 4, 1, d) > stop_mtbf(m, 4, 2, d) > stop_mtbf(m, 4, 3, d) > stop_mtbf(m, 4, 4, d)


def test_replica_ft_goodput_is_the_closed_form_and_beats_full_restarts_at_scale() -> None:
    args = dict(step_s=2.0, steps=10**6, save_s=5.0, restart_s=600.0, mtbf_s=3 * HOUR, state_bytes=4e9)
    full = goodput(young_daly_interval(5.0, 3 * HOUR), 5.0, 600.0, 3 * HOUR)
    ft = replica_ft(FtConfig(replicas=2, min_replicas=1), 8, **args, peer_bandwidth=50e9, full_restart_goodput=full)
    assert isinstance(ft, ReplicaFt) and ft.replicas == 2 and ft.min_replicas == 1
    assert ft.heal_s == pytest.approx(4e9 / 50e9) and ft.downtime_s == pytest.approx(600.08)
    m_stop = 2 * (3 * HOUR) ** 2 / 600.08
    assert ft.stop_mtbf_s == pytest.approx(m_stop) and ft.interval_s == pytest.approx(math.sqrt(2 * 5.0 * m_stop))
    tau = ft.checkpoint_every * 2.0
    alive = 1 - 600.08 / (2 * 3 * HOUR)
    assert ft.goodput == pytest.approx(tau / (tau + 5) * (1 - (600 + (tau + 5) / 2) / m_stop) * alive)
    assert ft.goodput > full + 0.05  # a failure every 3 h costs a full restart 10 minutes of every device
    # no group may be missing: every failure stops the job, and the groups only add their downtime
    strict = replica_ft(FtConfig(replicas=2, min_replicas=2), 8, **args, peer_bandwidth=50e9, full_restart_goodput=full)
    assert isinstance(strict, ReplicaFt) and strict.goodput < full
    assert prefer_ft(100.0, 98.0) and not prefer_ft(100.0, 99.5)


def test_replica_groups_come_from_ft_or_the_replicated_dimension() -> None:
    assert groups(FtConfig(), 4) == (4, 1)  # ft off: one group per replica, the key's default minimum
    assert groups(FtConfig(replicas=2, min_replicas=2), 4) == (2, 2)
    assert "does not divide this layout's dp_replicate=3" in groups(FtConfig(replicas=2), 3)
    assert "needs dp_replicate > 1" in groups(FtConfig(), 1)


def test_plan_weighs_replica_ft_on_the_fastest_layout_with_groups() -> None:
    batch = {"micro": "auto", "global": 2048}
    cfg = make_cfg(
        "405b",
        "h100_sxm",
        nodes=2048,
        seq_len=8192,
        batch=batch,
        **dict.fromkeys(("tp", "pp", "pp_schedule", "recompute"), "auto"),
    )
    prob, res = planner.plan(cfg, 16384)
    rank, b = ft_budget(res.ranked, 15e12, cfg.hardware, cfg.ft, prob.machine)
    assert all(p.layout.dp_replicate == 1 for p in res.ranked[: rank - 1])  # none faster has groups
    pred = res.ranked[rank - 1]
    assert pred.layout.dp_replicate > 1 and b == budget(pred, 15e12, cfg.hardware, cfg.ft, prob.machine)
    ft = b.replica_ft
    assert isinstance(ft, ReplicaFt) and ft.replicas == pred.layout.dp_replicate
    assert ft.heal_s == pytest.approx(pred.memory.checkpoint / peer_bandwidth(prob.machine, 16384))
    assert b.ft_wall_s == pytest.approx(b.ideal_s / ft.goodput) and ft.full_restart_goodput == b.goodput
    assert b.as_dict()["replica_ft"]["days"] == pytest.approx(b.ft_wall_s / DAY)
    assert budget(pred, 15e12, cfg.hardware).replica_ft is None  # not asked: not in the JSON either
    one = budget(res.ranked[0], 15e12, cfg.hardware, cfg.ft, prob.machine)
    if res.ranked[0].layout.dp_replicate == 1:
        assert "needs dp_replicate > 1" in one.as_dict()["replica_ft"]["unavailable"]


@pytest.mark.slow
def test_plan_prints_the_budget_and_the_comparison(tmp_path: Path) -> None:
    result = run_cli(
        "plan", "+model=8b", "nodes=1", "plan.top=1", "plan.tokens=1e12", "plan.compare=[h100_sxm,b200]", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "Budget: 1T tokens on layout #1 (8 x h100_sxm)" in out and "checkpoint.every=" in out
    assert "Young-Daly  sqrt(2 x" in out and "device-hours, $" in out
    assert "replica ft  " in out and ("use layout #" in out or "full restarts" in out)
    rows = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert "plan.compare: 1T tokens of 8b" in out and "b200" in rows and "h100_sxm" in rows


@pytest.mark.slow
def test_one_profile_without_brackets_gets_the_list_syntax(tmp_path: Path) -> None:
    result = run_cli("plan", "plan.tokens=1e12", "plan.compare=b200", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: plan.compare=b200: expected a list, e.g. plan.compare=[b200]"
