"""Tied embeddings across pipeline stages (launcher/parallel/tied.py) train as one process does: the
losses and gradient norms of 5 steps and the gradients after step 1 within 1e-4, and the tied matrix
after step 5, both copies equal bit for bit and to the one-process model's shared one (atol 1e-5;
other matrices are left to the losses: AdamW's normalized steps turn the rounding noise of an
element with a near-zero gradient into differences of 1e-5); the stage pairs of pp > 2, zero-bubble,
TP and FSDP included. The refusal of the V schedules is in tests/unit/test_layout.py, the checkpoint
across pp = 2 and pp = 1 in tests/integration/test_reshard.py, the planner's terms below.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from bench.published_runs import make_cfg as plan_cfg
from launcher.layout import Layout
from launcher.layout.rules import violations
from launcher.planner import memory
from launcher.planner.cost import step_time
from launcher.planner.request import resolve_machine
from tests.dist import run_many
from tests.integration.test_parallel import full, make_cfg, train_case

TIED = {"tied_embeddings": True}
CASES = {  # name: layout keys (the model of tests/integration/test_parallel.py, 4 layers, tied)
    "pp2-1f1b": dict(pp=2, pp_schedule="1f1b"),
    "pp2-interleaved-zb": dict(pp=2, pp_schedule="interleaved_zb", virtual_stages=2),
    "tp2-pp2": dict(tp=2, pp=2, pp_schedule="1f1b"),
    "dp2-pp2-fsdp": dict(dp=2, pp=2, batch={"micro": 2, "global": 8}),
    "pp4": dict(pp=4, pp_schedule="1f1b", batch={"micro": 2, "global": 8}),  # a pair group beside the middle
}
LAUNCHES = [(2, ["pp2-1f1b", "pp2-interleaved-zb"]), (4, ["tp2-pp2", "dp2-pp2-fsdp", "pp4"])]
SHARED = "tok_embeddings.weight"


def tied_case(keys: dict[str, Any], world_size: int) -> dict[str, Any]:
    """train_case of the tied model, plus this rank's weights after the last step."""
    final: dict[str, torch.Tensor] = {}

    def record(runner: Any) -> None:
        final.update({n: full(p) for part in runner.parts for n, p in part.named_parameters()})

    cfg = make_cfg("pre-rmsnorm", {**keys, "model": TIED})
    return {**train_case(cfg, world_size, each_step=record), "final": final}


def run_cases(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    return {name: tied_case(CASES[name], world_size) for name in names}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    jobs = [(run_cases, n, (names,)) for n, names in LAUNCHES]
    out: dict[str, list[dict[str, Any]]] = {}
    for per_rank in run_many(jobs, timeout=400):
        for name in per_rank[0]:
            out[name] = [r[name] for r in per_rank]
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return tied_case({}, 1)


def _by_name(ranks: list[dict[str, Any]], key: str) -> dict[str, list[torch.Tensor]]:
    """Every rank's tensors of `key` by the one-process name (the last stage's output copy: the
    embedding's)."""
    seen: dict[str, list[torch.Tensor]] = {}
    for result in ranks:
        for name, t in result[key].items():
            seen.setdefault(SHARED if name == "output.weight" else name, []).append(t)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_tied_pipeline_matches_one_process(results: dict, reference: dict, case: str) -> None:
    ranks = results[case]
    for rank, result in enumerate(ranks):
        for key in ("losses", "norms"):
            torch.testing.assert_close(
                result[key], reference[key], rtol=1e-4, atol=0, msg=lambda m, r=rank, k=key: f"rank {r} {k}: {m}"
            )
    for key, rtol, atol in (("weights", 0, 0), ("grads", 1e-4, 1e-6), ("final", 1e-4, 1e-5)):
        seen = _by_name(ranks, key)
        assert sorted(seen) == sorted(reference[key]), key
        for name, copies in seen.items():
            if key == "final" and name != SHARED:  # the losses say the rest; see the module docstring
                continue
            for t in copies:  # the embedding and its copy on the last stage, each as one process has it
                torch.testing.assert_close(t, reference[key][name], rtol=rtol, atol=atol, msg=lambda m, n=name: n + m)
    copies = _by_name(ranks, "final")[SHARED]
    assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies), "the copies stay equal bit for bit"


def test_planner_counts_the_last_stage_copy_and_its_all_reduce() -> None:
    """With pp > 1 the last pipeline rank holds the tied matrix again (weights, and with them its
    gradient and optimizer state: as an untied model does); with pp = 1 it does not. Each step
    all-reduces its gradient between the first and the last stage: longer with a larger vocabulary
    or a slower link, none with pp = 1 or untied weights."""
    cfg = plan_cfg("8b", "h100_sxm", nodes=2)
    tied, untied = (replace(cfg.model, tied_embeddings=t) for t in (True, False))
    machine = resolve_machine(cfg, 16)
    pp2, pp1 = Layout(tp=4, pp=2, microbatches=4), Layout(tp=4, microbatches=4)
    for rank in (0, 1):
        assert memory.rank_params(tied, pp2, rank) == memory.rank_params(untied, pp2, rank)
    assert memory.rank_params(untied, pp1, 0) - memory.rank_params(tied, pp1, 0) == tied.vocab_size * tied.dim // 4
    t_tied, t_untied = (step_time(m, 4096, pp2, machine, 2) for m in (tied, untied))
    assert t_tied.tied_comm > 0 and t_untied.tied_comm == 0
    assert t_tied.total == pytest.approx(t_untied.total + t_tied.tied_comm)
    assert step_time(tied, 4096, pp1, machine, 2).tied_comm == 0
    wide = step_time(replace(tied, vocab_size=2 * tied.vocab_size), 4096, pp2, machine, 2)
    assert wide.tied_comm > t_tied.tied_comm
    across = step_time(tied, 4096, replace(pp2, tp=8), machine, 2)  # the stages on two nodes: the network
    assert across.tied_comm > t_tied.tied_comm / 2  # half the shard, over a slower link


def test_planner_accepts_tied_pipelines_and_refuses_the_v_schedules() -> None:
    m = replace(plan_cfg("8b").model, tied_embeddings=True)
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2)):
        assert not list(violations(Layout(pp=4, schedule=schedule, virtual_stages=v, microbatches=8), m, 4096))
    for schedule in ("zbv", "dualpipev"):
        (line,) = violations(Layout(pp=4, schedule=schedule, virtual_stages=2, microbatches=8), m, 4096)
        assert "model.tied_embeddings=true" in line and "interleaved_zb" in line
