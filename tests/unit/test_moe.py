"""The MoE layer: routing, the selection-only bias, balancing, capacity, parameter and FLOP counts,
bad input, and checkpoints written at one ep resuming at another (routing biases included)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from launcher import flops
from launcher.config.schema import compose_config
from launcher.errors import LauncherError
from launcher.model.init import initialized_model
from launcher.model.moe import MoE, balance_step, moe_layers
from launcher.model.transformer import Transformer
from launcher.planner import resolve
from tests.conftest import assert_bad_input, run_cli, run_for, tiny_args


def moe_cfg(**moe: object):
    m = compose_config("+model=moe_tiny").model
    return dataclasses.replace(m, moe=dataclasses.replace(m.moe, **moe))


def layer(**moe: object) -> MoE:
    cfg = moe_cfg(**moe)
    return moe_layers([initialized_model(cfg, 3, torch.device("cpu"))])[0]


@pytest.mark.parametrize("variant", [{}, {"first_dense_layers": 1, "score": "softmax", "shared_experts": 0}])
def test_flops_and_params_match_the_module(variant: dict) -> None:
    cfg = moe_cfg(**variant)
    model = Transformer(cfg)
    assert flops.num_params(cfg) == sum(p.numel() for p in model.parameters())
    batch, seq = 2, 128
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (batch, seq))).sum().backward()
    assert counter.get_total_flops() == pytest.approx(flops.flops_per_token(cfg, seq) * batch * seq, rel=0.02)


@pytest.mark.parametrize(
    ("name", "total", "active"),  # billions, to the precision published
    [("mixtral_8x7b", "46.7", "12.9"), ("qwen3_30b_a3b", "30.5", "3.3"), ("qwen3_235b_a22b", "235", "22")],
)
def test_published_parameter_counts(name: str, total: str, active: str) -> None:
    """Within one unit of the last published digit: publishers round (Mixtral: 12.88B active is
    "12.9B") or cut (Qwen3-30B-A3B: 3.35B active is "3.3B")."""
    m = compose_config(f"+model={name}").model
    for count, published in ((flops.num_params(m), total), (flops.active_params(m), active)):
        unit = 10.0 ** -len(published.partition(".")[2])
        assert abs(count / 1e9 - float(published)) < unit, (count, published)


def test_head_dim_apart_from_width_over_heads() -> None:
    """Qwen3's head_dim 128 at width 2048 / 32 heads: the module and flops.py agree."""
    cfg = dataclasses.replace(moe_cfg(), head_dim=32)  # 4 heads of 32 at width 64
    model = Transformer(cfg)
    assert model.layers["0"].attention.wq.weight.shape == (4 * 32, 64)
    assert flops.num_params(cfg) == sum(p.numel() for p in model.parameters())
    assert model(torch.randint(0, 256, (1, 8))).shape == (1, 8, 256)


def test_bias_steers_selection_but_not_the_gates() -> None:
    moe = layer(shared_experts=0)
    x = torch.randn(10, moe.router.shape[1])
    moe.expert_bias[:] = torch.tensor([10.0, 10.0] + [0.0] * 6)  # experts 0 and 1 win every selection
    with torch.no_grad():
        y = moe(x)
        scores = torch.sigmoid(x @ moe.router.T)[:, :2]
        gates = scores / scores.sum(-1, keepdim=True)  # the raw scores, not scores + bias

        w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
        outs = [(torch.nn.functional.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e] for e in (0, 1)]
        expected = gates[:, :1] * outs[0] + gates[:, 1:] * outs[1]
    torch.testing.assert_close(y, expected)


def test_balance_step_moves_biases_towards_balance() -> None:
    moe = layer(bias_update_rate=0.5)
    moe.tokens_per_expert[:] = torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1])
    metrics = balance_step([moe], lambda t: t, lambda t: t)
    assert moe.expert_bias.tolist() == [-0.5] + [0.5] * 7  # down for the overloaded, up for the rest
    assert metrics["moe_load_imbalance"] == pytest.approx(9 / 2)
    assert metrics["moe_bias_abs_mean"] == pytest.approx(0.5)
    assert moe.tokens_per_expert.sum() == 0, "counts restart every step"
    frozen = layer(balance="none", bias_update_rate=0.5)
    frozen.tokens_per_expert[:] = torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1])
    balance_step([frozen], lambda t: t, lambda t: t)
    assert frozen.expert_bias.abs().sum() == 0


def test_capacity_drops_overflowing_tokens_and_dropless_does_not() -> None:
    for factor, dropped in ((None, False), (0.25, True)):
        moe = layer(capacity_factor=factor, balance="none")
        moe(torch.randn(64, moe.router.shape[1])).sum().backward()
        share = balance_step([moe], lambda t: t, lambda t: t)["moe_dropped_share"]
        assert (share > 0) == dropped


def test_aux_loss_reaches_the_router_gradient_only_when_asked() -> None:
    grads = {}
    for balance in ("aux", "none"):
        moe = layer(balance=balance, aux_loss_coef=1.0, shared_experts=0)
        x = torch.randn(2, 8, moe.router.shape[1])
        moe(x).sum().backward()
        grads[balance] = moe.router.grad.clone()
    assert not torch.allclose(grads["aux"], grads["none"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.moe.top_k=9"], "model.moe.top_k=9 exceeds model.moe.experts=8"),
        (["ep=3"], "ep=3 does not divide model.moe.experts=8"),
        (["ep=2", "dp=4", "dp_replicate=2", "dp_shard=2", "batch.global=16"], None),
        (["ep=4", "dp=4", "dp_replicate=2", "dp_shard=2", "batch.global=16"], "ep=4 does not divide dp_shard=2"),
        (["model.moe.balance=loss"], "model.moe.balance=loss: choose one of bias, aux, none"),
        (["model.moe.score=relu"], "model.moe.score=relu: choose one of sigmoid, softmax"),
    ],
)
def test_bad_moe_input_is_refused_before_any_process(overrides: list[str], expected: str | None) -> None:
    cfg = compose_config("+model=moe_tiny", "batch.micro=4", *overrides)
    if expected is None:
        resolve(cfg)  # accepted
        return
    with pytest.raises(LauncherError, match=expected.replace("(", r"\(")):
        resolve(cfg)


@pytest.mark.slow
def test_ep_on_a_dense_model_is_one_line_from_the_cli(tmp_path: Path) -> None:
    result = run_cli("train", *tiny_args(tmp_path / "cache"), "ep=2", cwd=tmp_path)
    assert_bad_input(result, "ep=2 needs a mixture-of-experts model", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        (["ep=2"], ["ep=1"]),  # experts over ep=2 (edp=1) -> one process
        (["ep=2", "dp=4"], ["ep=1", "dp=2"]),  # experts FSDP-sharded over edp=2 -> plain FSDP over 2
        (["ep=1", "dp=2"], ["ep=2", "dp=4"]),  # and back
    ],
)
def test_expert_parallel_checkpoint_resumes_at_another_ep_identically(
    tmp_path: Path, saved: list[str], resumed: list[str]
) -> None:
    args = [a if a != "+model=tiny" else "+model=moe_tiny" for a in tiny_args(tmp_path / "cache", steps=6)]
    common = [*args, "batch.global=8", "batch.micro=2", "threads=1"]
    common += ["model.moe.bias_update_rate=0.05", "checkpoint.every=3"]

    def run(name: str, *extra: str) -> list[dict]:
        result = run_cli("train", *common, f"run_dir={tmp_path / name}", *extra, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    straight = run("straight")
    run("saved", *saved, "steps=3")
    after = {r["step"]: r for r in run("saved", *resumed, f"checkpoint.dir={tmp_path / 'saved' / 'checkpoints'}")}
    for row in straight[3:]:
        for key in ("loss", "moe_load_imbalance", "moe_bias_abs_mean"):
            assert after[row["step"]][key] == pytest.approx(row[key], rel=1e-4, abs=1e-7), (row["step"], key)


@pytest.mark.slow
def test_bias_balancing_beats_none_and_matches_aux(tmp_path: Path) -> None:
    """On the byte corpus, 100 steps of a small MoE: `bias` ends far better balanced than `none`
    and no worse in validation loss than `aux` (loose bounds: the benchmark has the figures)."""
    from launcher.train.loop import train

    args = [a for a in tiny_args(tmp_path / "cache", steps=100) if a not in ("+model=tiny", "eval.every=0")]
    common = [*args, "+model=moe_tiny", "model.n_layers=2", "model.moe.experts=16", "seq_len=64", "batch.micro=8"]
    common += ["model.moe.bias_update_rate=0.01", "eval.every=100", "eval.batches=8", "checkpoint.every=0"]
    results = {}
    for mode in ("bias", "aux", "none"):
        cfg = compose_config(*common, f"model.moe.balance={mode}")
        summary = train(run_for(cfg), tmp_path / mode)
        rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        late = [r["moe_load_imbalance"] for r in rows[-10:]]
        results[mode] = (sum(late) / len(late), summary["val_loss"])
    assert results["bias"][0] < 0.75 * results["none"][0], results
    assert results["bias"][1] <= results["aux"][1] * 1.02, results
