"""Context parallelism matches the single-process run: the loss of each of 5 steps, the gradient norms
and the gradients after step 1 (fp32, rtol 1e-4), alone and composed with TP (and sequence
parallelism), FSDP, DDP (HSDP over dp x cp) and PP, for both model variants of tests/integration/test_parallel.py
(RoPE and learned positions), and under full recompute. Plus the load-balanced split itself, and
the planner's cp terms."""

from __future__ import annotations

import pytest
import torch

from launcher.data.context_split import local_positions, split_sequence
from tests.conftest import selected_cases
from tests.dist import run_many
from tests.integration.test_parallel import VARIANTS, make_cfg, train_case

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


@pytest.mark.slow
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


# ------------------------------------------- which SDPA kernel can take context parallelism's calls

SEQ, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 8  # GQA: two query heads per KV head


def _attend_recorded(rank: int, world_size: int, device_type: str, flash: bool) -> dict:
    """One GQA sequence's attention through this cp rank's `attend`, on a cp mesh of `device_type`,
    with the arguments of every `F.scaled_dot_product_attention` call it makes recorded. `flash`: torch's
    flash op stands in (CPU tensors) where SDPA would pick it on a GPU, recording the head counts it gets."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.attention import bias

    from launcher.config.model import ModelConfig
    from launcher.model.attention import Attention
    from launcher.parallel import context
    from launcher.parallel.context import apply_context_parallel

    real, calls, flash_calls = F.scaled_dot_product_attention, [], []

    def recorded(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):  # noqa: ANN001, ANN202
        kind = type(attn_mask).__name__ if attn_mask is not None else None
        calls.append(dict(mask=kind, causal=is_causal, gqa=enable_gqa, q=q.shape[-2], k=k.shape[-2]))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    def flash_op(q, k, v, dropout_p, is_causal, return_debug_mask, scale):  # noqa: ANN001, ANN202
        flash_calls.append((q.shape[1], k.shape[1], is_causal))
        offset = k.shape[-2] - q.shape[-2]  # flash's causal flag: aligned to the lower right
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(offset)
        return (real(q, k, v, attn_mask=keep, enable_gqa=True, scale=scale),)

    # context.py's calls only: torch's bias dispatches on F's own function
    context.F = SimpleNamespace(scaled_dot_product_attention=recorded)
    if flash:
        bias.can_use_flash_attention = lambda params, debug=False: True
        torch.ops.aten._scaled_dot_product_flash_attention = flash_op
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    cfg = ModelConfig(dim=HEADS * HEAD_DIM, n_heads=HEADS, n_kv_heads=KV_HEADS)
    model = nn.Sequential(Attention(cfg))
    apply_context_parallel(model, SimpleNamespace(get_group=lambda: dist.group.WORLD, device_type=device_type), SEQ)
    positions = local_positions(SEQ, world_size, rank)
    out = model[0].core(*(t[..., positions, :] for t in (q, k, v)))
    reference = real(q, k, v, is_causal=True, enable_gqa=True)[..., positions, :]
    return {"calls": calls, "flash": flash_calls, "error": (out - reference).abs().max().item()}


@pytest.fixture(scope="module")
def attention_calls() -> dict:
    cases = [("cuda", False), ("cuda", True), ("cpu", False)]
    return dict(zip(cases, run_many([(_attend_recorded, 2, case) for case in cases])))


@pytest.mark.slow
def test_gqa_attention_on_gpus_passes_sdpa_no_tensor_mask(attention_calls: dict) -> None:
    """On CUDA the flash kernel takes no attn_mask and the memory-efficient kernel no GQA (before recent
    torch), so a call with both leaves SDPA the math kernel, which materializes every score (aten's
    sdp_utils.cpp: `check_for_attn_mask` among flash's constraints). Each cp rank's calls on a cuda mesh pass
    no tensor mask: chunk 0 `is_causal` over a square block, the later chunk torch's lower-right
    `CausalBias`; the results equal one process's causal attention."""
    for rank in attention_calls["cuda", False]:
        assert rank["error"] < 1e-5
        assert len(rank["calls"]) == 2 and all(call["gqa"] for call in rank["calls"])
        for call in rank["calls"]:
            assert call["mask"] in (None, "CausalBias"), call
            assert call["mask"] is not None or (call["causal"] and call["q"] == call["k"]), call


@pytest.mark.slow
def test_gqa_attention_reaches_the_flash_kernel_with_kv_heads_unexpanded(attention_calls: dict) -> None:
    """Where torch can run flash (stood in for on CPU), each lower-right chunk is a call of its flash
    op, with 2 KV heads for 4 query heads and the causal flag; results unchanged. On CPU the additive
    mask (built once per run) stays: CPU's own flash kernel takes it with GQA."""
    for rank in attention_calls["cuda", True]:
        later = [call for call in rank["calls"] if call["mask"] == "CausalBias"]  # cp rank 1: both chunks
        assert later and rank["flash"] == [(HEADS, KV_HEADS, True)] * len(later) and rank["error"] < 1e-5
    for rank in attention_calls["cpu", False]:
        assert "Tensor" in [call["mask"] for call in rank["calls"]] and rank["error"] < 1e-5


# ---------------------------------------------------------------- the planner


def plan_405b(seq_len: int, **keys: object):
    from launcher import planner
    from tests.unit.test_planner import make_cfg

    auto = dict(tp="auto", pp="auto", cp="auto", pp_schedule="auto", recompute="auto")
    batch = {"micro": "auto", "global": 2**24 // seq_len}  # 16M tokens
    cfg = make_cfg("405b", "h100_sxm", nodes=2048, seq_len=seq_len, batch=batch, **{**auto, **keys})
    return planner.plan(cfg, 16384, explore=True)[1]


def test_cp_in_the_405b_search_on_16384_gpus() -> None:
    """cp joins the search at powers of two that leave each rank 4096 tokens at least (what keeps it
    fast: `python -m bench planner_speed` times it), and a 128K sequence is planned only with cp."""
    res = plan_405b(8192)
    assert {p.layout.cp for p in res.ranked} == {1, 2}
    long = plan_405b(131072, tp=8, pp=16)  # Llama 3's long-context stage: 128K tokens per sequence
    assert long.ranked[0].layout.cp > 1, "a 128K sequence does not fit without context parallelism"
    assert all(p.layout.cp > 1 for p in long.ranked)


def test_cp_memory_and_communication_terms() -> None:
    from dataclasses import replace

    from launcher.layout import Layout
    from launcher.planner.cost import step_time
    from launcher.planner.memory import memory
    from launcher.planner.request import resolve_machine
    from tests.unit.test_planner import make_cfg

    cfg = make_cfg("70b", "h100_sxm", nodes=4, seq_len=32768)
    m, machine = cfg.model, resolve_machine(cfg, 32)
    base = Layout(tp=8, dp_shard=2, micro=1, microbatches=1)
    one, two = (memory(m, 32768, replace(base, cp=cp), 2, "cuda") for cp in (1, 2))
    assert 0.5 < two.activations / one.activations < 0.6  # / cp, but K and V are saved whole (GQA: 1/8 of h)
    assert two.params == one.params / 2  # FSDP over dp_shard x cp
    assert two.buffers == one.buffers  # the flash kernel's lower-right causal flag: no mask
    one, two = (memory(m, 32768, replace(base, cp=cp), 2, "cpu") for cp in (1, 2))
    assert two.buffers - one.buffers == 2 * 8192 * (32768 + 8192)  # on a CPU the chunks' masks, c x (seq + c)
    inside, across = (step_time(m, 32768, Layout(tp=tp, cp=cp), machine, 2) for tp, cp in ((4, 2), (8, 2)))
    assert inside.cp_level == "nvlink4" and across.cp_level == "infiniband_ndr"
    assert 0 < inside.cp_comm < across.cp_comm
    assert step_time(m, 32768, base, machine, 2).cp_comm == 0
