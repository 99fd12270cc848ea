"""`model.moe.force_balance`: token t's pick j goes to expert (t*k + j) % E, gated by the router's scores there;
every expert's rows are known on the host, so the layer and expert parallelism's exchange compute what the
routing by counts computes without reading a tensor (they run on fake tensors, which have no values)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from launcher.compat.torch_compat import fake_store
from launcher.config.schema import compose_config
from launcher.model.init import materialize, meta_model
from launcher.model.moe import MoE, balance_step, balanced_picks, moe_layers
from launcher.ops.experts import Experts
from launcher.parallel.expert import balanced_split, exchange

# a fake tensor's host read (`.tolist()`), an output shape from its values (bincount, a mask)
VALUES_READ = (DataDependentOutputException, DynamicOutputShapeException)
UNEVEN = 13  # tokens: 26 picks over 8 experts, the first two get 4, the rest 3


def layer(fake: FakeTensorMode | None = None, **moe: object) -> MoE:
    """moe_tiny's first MoE layer with `moe` keys set; under `fake`, allocated as fake tensors (as the simulation
    does: from then on a real tensor meeting them is an error)."""
    m = compose_config("+model=moe_tiny").model
    model = meta_model(dataclasses.replace(m, moe=dataclasses.replace(m.moe, **moe)))
    with fake or contextlib.nullcontext():
        materialize([model], 3, torch.device("cpu"), draw=fake is None)
    if fake is not None:
        fake.allow_non_fake_inputs = False
    return moe_layers([model])[0]


def test_every_expert_gets_its_share_gated_by_the_router() -> None:
    moe = layer(force_balance=True, shared_experts=0)
    x = torch.randn(UNEVEN, moe.router.shape[1])
    y = moe(x)
    assert moe.tokens_per_expert.tolist() == [4, 4, 3, 3, 3, 3, 3, 3]
    picks = torch.arange(UNEVEN * 2).remainder(8).view(UNEVEN, 2)  # token t: experts 2t % 8 and (2t + 1) % 8
    with torch.no_grad():
        scores = torch.sigmoid(x @ moe.router.T).gather(1, picks)
        gates = scores / scores.sum(-1, keepdim=True)
        w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
        expected = torch.stack(
            [
                sum(g * (torch.nn.functional.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e] for g, e in zip(gates[t], p))
                for t, p in enumerate(picks.tolist())
            ]
        )
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    assert moe.router.grad.abs().sum() > 0, "the gates read the router's scores: it learns"
    metrics = balance_step([moe], lambda t: t, lambda t: t)
    assert metrics["moe_load_imbalance"] == pytest.approx(4 / 3.25) and metrics["moe_dropped_share"] == 0


@pytest.mark.parametrize("capacity", [None, 0.5, 1.0])
def test_the_host_counts_compute_what_the_tensor_counts_do(capacity: float | None) -> None:
    """The same picks routed twice: by their counts on the host (force_balance) and by counting them in a tensor
    (bincount, the capacity's mask): the same outputs, gradients and counters, bitwise."""
    results = []
    for host in (True, False):
        moe = layer(force_balance=True, capacity_factor=capacity, shared_experts=0)
        x = torch.randn(UNEVEN, moe.router.shape[1], generator=torch.Generator().manual_seed(0), requires_grad=True)
        idx, counts = balanced_picks(UNEVEN, 2, 8, x.device)
        weights = torch.rand(UNEVEN, 2, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = moe.route(x, idx, weights, counts if host else None)
        y.square().sum().backward()
        results.append([y, x.grad, weights.grad, moe.experts.w1.grad, moe.tokens_per_expert, moe.dropped])
    for got, want in zip(*results):
        assert torch.equal(got, want)
    dropped = results[0][-1].item()
    assert dropped == (0 if capacity in (None, 1.0) else UNEVEN * 2 - 8 * 2)  # capacity 0.5: 2 rows an expert


def test_the_balanced_split_is_the_one_exchanged_counts_give() -> None:
    """Rank 1 of ep=2: what `exchange` learns from the counts' all-to-all (every rank routing alike) and sorts."""
    host, ep, rank = [4, 4, 3, 3, 3, 3, 3, 3], 2, 1
    send, recv, order, per_expert = balanced_split(host, ep, rank, torch.device("cpu"))
    received = torch.tensor([host[4:]] * ep)  # from each rank: its rows for my experts 4..7
    local = torch.arange(4).repeat(ep).repeat_interleave(received.flatten())
    assert send == [14, 12] and recv == [12, 12] and per_expert == received.sum(0).tolist()
    assert torch.equal(order, local.argsort(stable=True))


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_a_balanced_layer_reads_no_value(capacity: float | None) -> None:
    """On fake tensors (no values: a host read or a shape from values raises) a balanced layer runs forward and
    backward; routed by the router's top k it cannot (the guard of this test)."""
    for balanced in (True, False):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        moe = layer(fake, force_balance=balanced, capacity_factor=capacity)
        with fake:
            x = torch.randn(4, UNEVEN, moe.router.shape[1])
            if not balanced:
                with pytest.raises(VALUES_READ):
                    moe(x)
                continue
            y = moe(x)
            y.sum().backward()
            assert y.shape == x.shape and moe.router.grad is not None


def test_a_balanced_exchange_reads_no_value() -> None:
    """Expert parallelism's exchange on fake tensors over the fake process group (ep=2, rank 0): with the host's
    counts it runs forward and backward; learning them from the counts' all-to-all it cannot."""
    host = [4, 4, 3, 3, 3, 3, 3, 3]
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        with FakeTensorMode():
            experts = Experts(4, 8, 16)  # this rank's 4 of 8
            for p in experts.parameters():
                torch.nn.init.normal_(p)
            x = torch.randn(sum(host), 8, requires_grad=True)
            out = exchange(x, torch.tensor(host), experts, dist.group.WORLD, host=host)
            out.sum().backward()
            assert out.shape == x.shape and experts.w1.grad is not None
            with pytest.raises(VALUES_READ):
                exchange(x, torch.tensor(host), experts, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
