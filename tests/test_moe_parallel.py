"""Expert parallelism matches one process: moe_tiny (dropless, balance=bias) at ep=2, ep=2 x tp=2 and
ep=2 x pp=2 gives the single-process losses and gradient norms of 5 steps (rtol 1e-4), the same
gradients after step 1, and the same routing biases after the last step (the token counts are summed
over the data-parallel ranks, so every rank moves its biases alike)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from launcher.config import compose_config
from launcher.layout import build_mesh, from_config
from launcher.model.init import meta_model
from launcher.parallel import parallelize
from launcher.train.optim import build_optimizer
from tests.dist import run_many
from tests.test_parallel import batch, full

STEPS, SEQ, GLOBAL_BATCH = 5, 16, 8
CASES = {"ep2": dict(ep=2), "ep2-tp2": dict(ep=2, tp=2), "ep2-pp2": dict(ep=2, pp=2, batch={"micro": 2, "global": 8})}


def make_cfg(**keys: Any) -> Any:
    cfg = compose_config("+model=moe_tiny", "batch.micro=4", f"batch.global={GLOBAL_BATCH}", f"seq_len={SEQ}")
    cfg = replace(cfg, steps=STEPS, seed=7, optim=replace(cfg.optim, lr=1e-2, warmup_steps=1, grad_clip=0.5))
    # a faster bias (gamma) than the default, so the biases steer the routing within 5 steps
    return replace(cfg, model=replace(cfg.model, moe=replace(cfg.model.moe, bias_update_rate=0.05)), **keys)


def train_case(cfg: Any, world_size: int) -> dict[str, Any]:
    layout = from_config(cfg, world_size)
    mesh = build_mesh(layout, "cpu") if world_size > 1 else None
    runner = parallelize(meta_model(cfg.model), layout, cfg, None, torch.device("cpu"), mesh)
    optimizer, schedule = build_optimizer(runner.parts, cfg.optim, cfg.steps)
    dp_rank = layout.coordinates(torch.distributed.get_rank())["dp"] if mesh is not None else 0
    local = GLOBAL_BATCH // layout.dp
    losses, norms, imbalance, grads = [], [], [], {}
    for step in range(1, cfg.steps + 1):
        x, y = (t[dp_rank * local : (dp_rank + 1) * local] for t in batch(step))
        losses.append(runner.forward_backward(x, y))
        if step == 1:
            grads = {n: full(p.grad) for part in runner.parts for n, p in part.named_parameters()}
        norms.append(runner.clip_grad_norm(cfg.optim.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        imbalance.append(runner.update_balance()["moe_load_imbalance"])
    biases = {n: b.clone() for part in runner.parts for n, b in part.named_buffers() if n.endswith("expert_bias")}
    return {"losses": losses, "norms": norms, "imbalance": imbalance, "grads": grads, "biases": biases}


def run_cases(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    return {name: train_case(make_cfg(**CASES[name]), world_size) for name in names}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    reference = train_case(make_cfg(), 1)
    (two,) = run_many([(run_cases, 2, (["ep2"],))])
    (four,) = run_many([(run_cases, 4, (["ep2-tp2", "ep2-pp2"],))])
    ranks = {case: [r[case] for r in world] for world in (two, four) for case in world[0]}
    return {"reference": reference, "ranks": ranks}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_one_process(results: dict[str, Any], case: str) -> None:
    ref = results["reference"]
    assert any(b.abs().sum() > 0 for b in ref["biases"].values()), "the biases moved"
    for rank, got in enumerate(results["ranks"][case]):
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-4, atol=0, msg=f"{case} rank {rank} losses")
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=0)
        torch.testing.assert_close(got["imbalance"], ref["imbalance"], rtol=1e-5, atol=0)
        for name, bias in got["biases"].items():  # a pipeline stage holds some layers
            torch.testing.assert_close(bias, ref["biases"][name], rtol=0, atol=1e-6, msg=f"{case} {name}")
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=f"{case} grad {name}")
