"""Expert parallelism matches one process: moe_tiny (dropless, balance=bias) at ep=2, ep=2 x tp=2
(also with sequence parallelism), ep=2 x pp=2 (1F1B, and zero-bubble, where the experts' loop is
autograd's chain), ep=2 on dp_shard=4 (experts FSDP-sharded over edp=2) and ep=2 under HSDP gives
the single-process losses and gradient norms of 5 steps (rtol 1e-4), the same gradients after step
1, and the same routing biases after the last step (the token counts are summed over the
data-parallel ranks, so every rank moves its biases alike). Also with the routing forced balanced
(`model.moe.force_balance`: the exchange's splits from the host's counts), dropless and with a
capacity, and with a first pipeline stage of dense layers only (`first_dense_layers`): it joins the
balance step's sum over stages (a stage that skipped it hung the job; the launch's timeout fails such
a hang fast)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from launcher.config.schema import compose_config
from launcher.metrics.moe_load import layer_loads
from launcher.model.moe import local, moe_layers
from tests.conftest import selected_cases
from tests.dist import run_many
from tests.integration.test_parallel import train_case as parallel_case

pytestmark = pytest.mark.slow

STEPS, SEQ, GLOBAL_BATCH = 5, 16, 8
MICRO2 = {"batch": {"micro": 2, "global": 8}}
DENSE_FIRST = {"first_dense_layers": 1}  # moe_tiny's 2 layers at pp=2: stage 0 dense only
BALANCED = {"force_balance": True}  # every expert the same rows: the biases never move
CASES = {
    "ep2": dict(ep=2),
    "ep2-tp2": dict(ep=2, tp=2),
    "ep2-tp2-sp": dict(ep=2, tp=2, sequence_parallel=True),
    "ep2-pp2": dict(ep=2, pp=2, **MICRO2),
    # zero-bubble: the routed experts run as autograd's chain, whose weight passes the schedule splits off
    "ep2-pp2-zb": dict(ep=2, pp=2, pp_schedule="interleaved_zb", **MICRO2),
    "dense-stage-ep2-pp2": dict(ep=2, pp=2, moe=DENSE_FIRST, **MICRO2),
    "ep2-edp2": dict(ep=2, **MICRO2),  # dp_shard=4: experts FSDP-sharded over edp=2
    "ep2-hsdp": dict(ep=2, dp_replicate=2, dp_shard=2, **MICRO2),  # edp=1, replicated over dp_replicate
    # 2 experts: 1 per ep rank, fewer than edp=2, so FSDP cuts each expert's dim 1 instead
    "two-experts-ep2-edp2": dict(ep=2, moe={"experts": 2, "top_k": 1}, **MICRO2),
    # force_balance: round-robin picks, the exchange's splits from counts on the host (no counts' all-to-all);
    # with a capacity below the fair share each expert drops half its picks
    "ep2-balanced": dict(ep=2, moe=BALANCED),
    "ep2-balanced-capacity": dict(ep=2, moe={**BALANCED, "capacity_factor": 0.5}),
}
# each rank's (experts, dim, hidden) shard of w1: 8 / ep experts, unless FSDP cuts them over edp > 1
W1_SHARD = {"ep2-edp2": (2, 64, 64), "two-experts-ep2-edp2": (1, 32, 64)}
# experts in an FSDP unit of their own: where their mesh (dp_replicate x edp) has more than one rank
FSDP_EXPERTS = {"ep2-edp2", "ep2-hsdp", "two-experts-ep2-edp2"}


def make_cfg(moe: dict[str, Any] | None = None, **keys: Any) -> Any:
    cfg = compose_config("+model=moe_tiny", "batch.micro=4", f"batch.global={GLOBAL_BATCH}", f"seq_len={SEQ}")
    cfg = replace(cfg, steps=STEPS, seed=7, optim=replace(cfg.optim, lr=1e-2, warmup_steps=1, grad_clip=0.5))
    # a faster bias (gamma) than the default, so the biases steer the routing within 5 steps
    moe_cfg = replace(cfg.model.moe, bias_update_rate=0.05, **(moe or {}))
    return replace(cfg, model=replace(cfg.model, moe=moe_cfg), **keys)


def train_case(cfg: Any, world_size: int) -> dict[str, Any]:
    """test_parallel's case, plus the load imbalance and per-layer loads after every step and the biases
    after the last."""
    imbalance: list[float] = []
    loads: list[list[Any]] = []
    parts: list[torch.nn.Module] = []

    def each_step(runner: Any) -> None:
        balance = runner.update_balance(per_layer=True)
        imbalance.append(balance["moe_load_imbalance"])
        loads.append(layer_loads(balance["moe_layers"]))
        parts[:] = runner.parts

    out = parallel_case(cfg, world_size, each_step=each_step)
    biases = {n: b.clone() for part in parts for n, b in part.named_buffers() if n.endswith("expert_bias")}
    w1 = {tuple(local(p).shape) for part in parts for n, p in part.named_parameters() if n.endswith("experts.w1")}
    fsdp = {isinstance(moe.experts, FSDPModule) for moe in moe_layers(parts)}  # {}: a dense stage
    chain = {moe.experts.split_weights for moe in moe_layers(parts)}  # the loop as autograd's chain
    return {
        **out, "imbalance": imbalance, "loads": loads, "biases": biases, "w1_shards": w1, "fsdp_experts": fsdp,
        "chain": chain,
    }  # fmt: skip


def run_cases(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    return {name: train_case(make_cfg(**CASES[name]), world_size) for name in names}


# what runs where: one launch after another
LAUNCHES = [
    (2, ["ep2", "ep2-balanced", "ep2-balanced-capacity"]),
    (4, ["ep2-tp2", "ep2-tp2-sp", "ep2-pp2", "ep2-pp2-zb", "dense-stage-ep2-pp2"]),
    (4, ["ep2-edp2", "ep2-hsdp", "two-experts-ep2-edp2"]),
]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> dict[str, Any]:
    wanted = [name for (name,) in selected_cases(request, case=CASES)]
    models = {repr(CASES[name].get("moe")): CASES[name].get("moe") for name in wanted}
    references = {key: train_case(make_cfg(moe=moe), 1) for key, moe in models.items()}
    worlds = [(n, [name for name in names if name in wanted]) for n, names in LAUNCHES]
    ran = [run_many([(run_cases, n, (names,))], timeout=120)[0] for n, names in worlds if names]
    ranks = {case: [r[case] for r in world] for world in ran for case in world[0]}
    return {"references": references, "ranks": ranks}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_one_process(results: dict[str, Any], case: str) -> None:
    ref = results["references"][repr(CASES[case].get("moe"))]
    balanced = (CASES[case].get("moe") or {}).get("force_balance", False)
    assert any(b.abs().sum() > 0 for b in ref["biases"].values()) != balanced, "the biases moved, unless balanced"
    for rank, got in enumerate(results["ranks"][case]):
        assert got["w1_shards"] <= {W1_SHARD.get(case, (4, 64, 64))}, got["w1_shards"]  # {}: a dense stage
        assert got["fsdp_experts"] <= {case in FSDP_EXPERTS}, got["fsdp_experts"]
        assert got["chain"] <= {case.endswith("-zb")}, got["chain"]  # else one node per layer's loop
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-4, atol=0, msg=f"{case} rank {rank} losses")
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=0)
        torch.testing.assert_close(got["imbalance"], ref["imbalance"], rtol=1e-5, atol=0)
        # every layer's tokens per expert on every rank, pipeline stages included (summed over stages)
        assert [[(a.layer, a.tokens) for a in step] for step in got["loads"]] == [
            [(a.layer, a.tokens) for a in step] for step in ref["loads"]
        ]
        for name, bias in got["biases"].items():  # a pipeline stage holds some layers
            torch.testing.assert_close(bias, ref["biases"][name], rtol=0, atol=1e-6, msg=f"{case} {name}")
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=f"{case} grad {name}")
