"""Zero-bubble pipeline schedules (interleaved_zb, zbv, dualpipev) match one process: the losses and
gradient norms of 5 steps, the gradients after step 1 and a validation loss after every step (fp32,
rtol 1e-4), at pp=2 and at pp=2 with tp=2, on gloo; and a checkpoint written under one schedule
resumes under another.

Cases run in one launch: two 2-rank worlds (pp=2) side by side would need 4 processes already, so
the pp=2 cases share one 2-rank world and the tp=2 x pp=2 cases one 4-rank world, one after the
other. 2 sequences per microbatch: 4 microbatches per step (dualpipev needs 2 x pp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from launcher.config.layout_keys import from_config
from launcher.layout import Layout, owner_rank, rank_stages
from tests.conftest import losses
from tests.dist import run
from tests.integration.test_parallel import batch, make_cfg, train_case
from tests.unit.test_layout import error

SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")
VARIANT = "pre-rmsnorm"  # SwiGLU, GQA, RoPE: the shapes the planner's memory model is exact for
BATCH = {"micro": 2, "global": 8}


def case(schedule: str, tp: int) -> dict[str, Any]:
    v = {"virtual_stages": 2} if schedule == "interleaved_zb" else {}
    return dict(tp=tp, pp=2, pp_schedule=schedule, batch=BATCH, **v)


def evaluated(cfg: Any, world_size: int) -> dict[str, Any]:
    """`train_case`, and the validation loss of one batch after every step (`runner.evaluate`: the V
    schedules' own evaluation crashed at the first one)."""
    x, y = batch(99)  # no data parallelism in these cases: the whole batch on every rank
    evals: list[float] = []
    return train_case(cfg, world_size, each_step=lambda runner: evals.append(runner.evaluate(x, y))) | {"evals": evals}


def run_schedules(rank: int, world_size: int, tp: int) -> dict[str, Any]:
    return {s: evaluated(make_cfg(VARIANT, case(s, tp)), world_size) for s in SCHEDULES}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return evaluated(make_cfg(VARIANT, {"batch": BATCH}), 1)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2-pp2"])
def test_zero_bubble_schedules_match_single_process(reference: dict[str, Any], tp: int) -> None:
    per_rank = run(run_schedules, 2 * tp, tp, timeout=600)
    for schedule in SCHEDULES:
        grads: dict[str, torch.Tensor] = {}
        for rank, ranks in enumerate(per_rank):
            got = ranks[schedule]
            msg = f"{schedule} rank {rank}"
            torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-4, atol=0, msg=msg)
            torch.testing.assert_close(got["norms"], reference["norms"], rtol=1e-4, atol=0, msg=msg)
            torch.testing.assert_close(got["evals"], reference["evals"], rtol=1e-4, atol=0, msg=f"{msg}: eval")
            grads.update(got["grads"])
        assert sorted(grads) == sorted(reference["grads"]), schedule
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-4, atol=1e-6, msg=f"{schedule} {name}")


@pytest.mark.slow
def test_checkpoint_resumes_across_schedules(tmp_path: Path) -> None:
    """Saved under zbv (V placement: rank 0 holds stages 0 and 3), resumed under interleaved_zb
    (looped: rank 0 holds 0 and 2): parameter names are global, so the checkpoint does not care."""
    from tests.integration.test_reshard import run as run_layout

    common = ("model.n_layers=4", "batch.micro=2")
    reference = losses(run_layout(tmp_path / "ref", "single", "checkpoint.every=0", *common))
    saved = run_layout(tmp_path, "saved", "checkpoint.every=3", "pp=2", "pp_schedule=zbv", *common)
    checkpoint = saved / "checkpoints" / "step_00000003"
    resumed = run_layout(
        tmp_path, "resumed", f"resume={checkpoint}", "checkpoint.every=0", "pp=2", "pp_schedule=interleaved_zb",
        "virtual_stages=2", *common,
    )  # fmt: skip
    got = losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([reference[s] for s in (4, 5, 6)], rel=1e-4)


def test_v_placement_matches_torch_and_puts_the_loss_on_pipeline_rank_0() -> None:
    from torch.distributed.pipelining.schedules import generate_rank_to_stage_mapping

    for pp in (2, 3, 4):
        v = generate_rank_to_stage_mapping(pp, 2 * pp, style="v")
        loop = generate_rank_to_stage_mapping(pp, 2 * pp, style="loop")
        for r in range(pp):
            assert rank_stages(r, pp, 2, v_shape=True) == v[r]
            assert rank_stages(r, pp, 2) == loop[r]
    lay = Layout(tp=2, pp=2, microbatches=4, schedule="zbv", virtual_stages=2)
    assert lay.pp_stages(0) == [0, 3] and owner_rank(lay) == 0


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ("pp=4", "pp_schedule=zbv"),
            r"^pp_schedule=zbv needs 2 x pp = 8 stages, more than model.n_layers=4: use pp <= 2",
        ),
        (
            ("pp=3", "pp_schedule=dualpipev", "microbatches=6"),
            r"^pp_schedule=dualpipev needs 2 x pp = 6 stages, more than",
        ),
        (("pp=2", "pp_schedule=interleaved_zb", "virtual_stages=4"), r"^pp x virtual_stages = 2 x 4 = 8 stages exceed"),
        (("pp=2", "pp_schedule=zbv", "virtual_stages=3"), r"^pp_schedule=zbv holds exactly 2 stages per rank"),
        (("pp=2", "pp_schedule=dualpipev", "microbatches=3"), r"^3 microbatches per step cannot fill the 2 x pp = 4"),
        (
            ("pp=2", "pp_schedule=interleaved_zb", "microbatches=3"),
            r"^microbatches=3 is not a multiple of pp=2 \(interleaved_zb\)",
        ),
        (("pp=2", "pp_schedule=zbv", "compile=true"), r"^pp_schedule=zbv splits the backward .* set compile=false"),
        (
            ("pp=2", "virtual_stages=2", "pp_schedule=1f1b"),
            r"^virtual_stages=2 needs pp_schedule=interleaved_1f1b or interleaved_zb",
        ),
    ],
)
def test_bad_schedule_layouts_fail_with_one_line(overrides: tuple[str, ...], expected: str) -> None:
    import re

    assert re.search(expected, error(*overrides)), error(*overrides)


def grid() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, virtual stages, microbatches) that torch accepts and the layout rules allow."""
    out = []
    for p in (2, 3, 4, 5):
        for m in range(p, 4 * p + 1):
            out += [("interleaved_1f1b", p, v, m) for v in (2, 3) if m % p == 0]
            out += [("interleaved_zb", p, v, m) for v in (1, 2, 3) if m % p == 0]
            out += [("zbv", p, 2, m)]
            out += [("dualpipev", p, 2, m)] if m >= 2 * p else []
    return out


@pytest.mark.slow
def test_planner_bubble_and_in_flight_match_torchs_action_orders() -> None:
    """The planner's closed forms against the timeline of the orders torch runs (forward, input and
    weight gradient equally long): the busiest rank's idle time, and each rank's peak of microbatch
    activations held (in units of all its layers)."""
    from launcher.compat.pipeline_compat import schedule_actions
    from launcher.parallel.pipeline import schedule_class
    from launcher.planner.cost import bubble_slots
    from launcher.planner.memory import in_flight, logits_in_flight
    from launcher.planner.timeline import peak_in_flight, simulate

    for schedule, p, v, m in grid():
        lay = Layout(pp=p, microbatches=m, schedule=schedule, virtual_stages=v)
        orders = schedule_actions(schedule_class(schedule), p, [lay.pp_stages(r) for r in range(p)], m)
        case = (schedule, p, v, m)
        assert bubble_slots(lay) == pytest.approx(simulate(orders).bubble() / (3 * v)), case
        for r in range(p):
            assert in_flight(lay, r) == pytest.approx(peak_in_flight(orders[r]) / v), (*case, r)
        last = {s: float(s == p * v - 1) for s in range(p * v)}  # the loss's stage only
        assert logits_in_flight(lay) == peak_in_flight(orders[lay.last_rank], last), case


def test_docs_timelines_are_the_planners() -> None:
    """Each timeline picture in docs/parallelism.md is what `bench.schedules.timeline_text` draws now."""
    import re

    from bench.schedules import timeline_text
    from tests.conftest import ROOT

    text = (ROOT / "docs" / "parallelism.md").read_text()
    pattern = r"<!-- timeline: (\w+) pp=(\d+) microbatches=(\d+) virtual_stages=(\d+) -->\n```text\n(.*?)\n```"
    pictures = re.findall(pattern, text, re.S)
    assert {p[0] for p in pictures} == {"interleaved_1f1b", *SCHEDULES}
    for schedule, pp, m, v, picture in pictures:
        assert picture == timeline_text(schedule, int(pp), int(m), int(v)), schedule


def test_timeline_of_a_hand_written_1f1b_order() -> None:
    """Two stages, two microbatches, 1F1B by hand: the bubble is (p - 1) x (F + B) = 3, stage 0 holds
    both microbatches; an order that waits on itself is reported, not hung on."""
    from launcher.planner.timeline import peak_in_flight, render, simulate

    orders = {
        0: [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)],
        1: [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)],
    }
    t = simulate(orders)
    assert (t.makespan, t.bubble()) == (9.0, 3.0)
    assert [peak_in_flight(orders[r]) for r in (0, 1)] == [2.0, 1.0]
    assert render(t).splitlines()[1] == "rank 1 |  ..  F0  B0  B0  F1  B1  B1  ..  .."
    with pytest.raises(ValueError, match="deadlock"):
        simulate({0: [("B", 0, 0), ("F", 0, 0)]})


@pytest.mark.slow
def test_planner_activations_per_rank_equal_the_runtimes_for_every_schedule() -> None:
    """Peak bytes autograd holds saved for each rank's blocks over one step (saved-tensor hooks, pp=2,
    the `small` model, 4 microbatches of 2 x 256) equal the planner's activations for that rank."""
    from bench.schedules import CASES, SEQ, case_config, worker
    from launcher.planner.memory import rank_memory

    per_rank = run(worker, 2, list(CASES), 0, timeout=600)
    for name in CASES:
        cfg = case_config(name)
        lay = from_config(cfg, 2)
        for r in range(2):
            predicted = rank_memory(cfg.model, SEQ, lay, 4, "cpu", r).activations
            assert per_rank[r][name]["peak"] == predicted, (name, r)
            assert per_rank[r][name]["leftover"] == 0, (name, r)  # all freed by the step's end
