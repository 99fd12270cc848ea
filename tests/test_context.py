"""Context parallelism matches the single-process run: the loss of each of 5 steps, the gradient norms
and the gradients after step 1 (fp32, rtol 1e-4), alone and composed with TP (and sequence
parallelism), FSDP, DDP (HSDP over dp x cp) and PP, for both model variants of tests/test_parallel.py
(RoPE and learned positions), and under full recompute. Plus the load-balanced split itself, and
the planner's cp terms."""

from __future__ import annotations

import pytest
import torch

from launcher.parallel.context import local_positions, split_sequence
from tests.conftest import selected_cases
from tests.dist import run_many
from tests.test_parallel import VARIANTS, make_cfg, train_case

CASES = {
    "cp2": dict(cp=2),
    "cp2-recompute": dict(cp=2, recompute="full"),  # the recomputed forward gathers K and V again
    "cp2-tp2": dict(cp=2, tp=2),
    "cp2-tp2-sp": dict(cp=2, tp=2, sequence_parallel=True),
    "cp2-fsdp2": dict(cp=2, dp=2, batch={"micro": 2, "global": 8}),
    "cp2-ddp2": dict(cp=2, dp=2, dp_shard=1, batch={"micro": 2, "global": 8}),  # HSDP: replicate 2 x shard cp 2
    "cp2-pp2": dict(cp=2, pp=2, pp_schedule="1f1b"),
}
LAUNCHES = [(2, ["cp2", "cp2-recompute"]), (4, ["cp2-tp2", "cp2-tp2-sp", "cp2-fsdp2", "cp2-ddp2", "cp2-pp2"])]


def test_each_rank_gets_an_early_and_a_late_chunk() -> None:
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        held = torch.cat([local_positions(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))  # every token once
        work = [int((local_positions(32, cp, r) + 1).sum()) for r in range(cp)]  # keys each rank's queries see
        assert len(set(work)) == 1, work
    rows = torch.arange(32).view(2, 16)
    assert split_sequence(rows, 2, 1).tolist() == [list(range(4, 12)), list(range(20, 28))]


def test_loader_gives_each_cp_rank_its_chunks_of_the_same_sequences() -> None:
    import numpy as np

    from launcher.data import BatchLoader

    tokens = np.arange(10_000) % 251
    whole = BatchLoader(tokens, 16, 8, dp_rank=1, dp_size=2, seed=3).next_batch()
    parts = [BatchLoader(tokens, 16, 8, 1, 2, 3, cp_rank=r, cp_size=2).next_batch() for r in range(2)]
    for i in range(2):  # inputs, then targets
        rebuilt = torch.empty_like(whole[i])
        for r, part in enumerate(parts):
            assert part[i].shape == (4, 8)
            rebuilt[:, local_positions(16, 2, r)] = part[i]
        assert torch.equal(rebuilt, whole[i])


def run_cases(rank: int, world_size: int, keys: list[tuple[str, str]]) -> dict:
    return {(v, n): train_case(make_cfg(v, CASES[n]), world_size) for v, n in keys}


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict:
    out = {}
    wanted = selected_cases(request, variant=VARIANTS, case=CASES)
    worlds = [(n, [(v, name) for v, name in wanted if name in names]) for n, names in LAUNCHES]
    for per_rank in run_many([(run_cases, n, (keys,)) for n, keys in worlds if keys], timeout=600):
        for key in per_rank[0]:
            out[key] = [r[key] for r in per_rank]
    return out


@pytest.fixture(scope="module")
def references(request: pytest.FixtureRequest) -> dict:
    wanted = {v for v, _ in selected_cases(request, variant=VARIANTS, case=CASES)}
    return {v: train_case(make_cfg(v), 1) for v in VARIANTS if v in wanted}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(results: dict, references: dict, variant: str, case: str) -> None:
    ref = references[variant]
    grads: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results[variant, case]):
        for key in ("losses", "norms"):
            torch.testing.assert_close(result[key], ref[key], rtol=1e-4, atol=0, msg=lambda m, r=rank: f"{r}: {m}")
        grads.update(result["grads"])
    assert sorted(grads) == sorted(ref["grads"])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- the planner


def plan_405b(seq_len: int, **keys: object):
    from launcher import planner
    from tests.test_planner import make_cfg

    auto = dict(tp="auto", pp="auto", cp="auto", pp_schedule="auto", recompute="auto")
    batch = {"micro": "auto", "global": 2**24 // seq_len}  # 16M tokens
    cfg = make_cfg("405b", "h100_sxm", nodes=2048, seq_len=seq_len, batch=batch, **{**auto, **keys})
    return planner.plan(cfg, 16384, explore=True)[1]


def test_cp_in_the_405b_search_on_16384_gpus_under_a_second() -> None:
    import time

    plan_405b(8192)  # warm imports
    times = []
    for _ in range(2):  # the better of two: this machine is shared
        t0 = time.perf_counter()
        res = plan_405b(8192)
        times.append(time.perf_counter() - t0)
    assert min(times) < 1.0 and {p.layout.cp for p in res.ranked} == {1, 2}  # 4096 tokens per rank at least
    long = plan_405b(131072, tp=8, pp=16)  # Llama 3's long-context stage: 128K tokens per sequence
    assert long.ranked[0].layout.cp > 1, "a 128K sequence does not fit without context parallelism"
    assert all(p.layout.cp > 1 for p in long.ranked)


def test_cp_memory_and_communication_terms() -> None:
    from dataclasses import replace

    from launcher.layout import Layout
    from launcher.planner.cost import step_time
    from launcher.planner.memory import memory
    from launcher.planner.request import resolve_machine
    from tests.test_planner import make_cfg

    cfg = make_cfg("70b", "h100_sxm", nodes=4, seq_len=32768)
    m, machine = cfg.model, resolve_machine(cfg, 32)
    base = Layout(tp=8, dp_shard=2, micro=1, microbatches=1)
    one, two = (memory(m, 32768, replace(base, cp=cp), 2, "cuda") for cp in (1, 2))
    assert 0.5 < two.activations / one.activations < 0.6  # / cp, but K and V are saved whole (GQA: 1/8 of h)
    assert two.params == one.params / 2  # FSDP over dp_shard x cp
    assert two.buffers - one.buffers == 2 * 8192 * (32768 + 8192)  # the chunks' bf16 masks, c x (seq + c)
    inside, across = (step_time(m, 32768, Layout(tp=tp, cp=cp), machine, 2) for tp, cp in ((4, 2), (8, 2)))
    assert inside.cp_level == "nvlink4" and across.cp_level == "infiniband_ndr"
    assert 0 < inside.cp_comm < across.cp_comm
    assert step_time(m, 32768, base, machine, 2).cp_comm == 0
