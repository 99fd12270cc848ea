"""The experts' paths: the grouped GEMM (`torch._grouped_mm`, which runs on CPU too, as a loop inside
the op) gives the loop's outputs and gradients, groups padded or not; the path is chosen once: grouped
only on a CUDA sm90/sm100 device computing in bf16 with aligned widths. The loop is one autograd node
(`ExpertLoop`), bitwise autograd's chain, saving gate and up only; zero-bubble schedules keep the chain."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from launcher.config.layout_keys import from_config
from launcher.config.schema import compose_config
from launcher.model.init import initialized_model, meta_model
from launcher.model.knobs import Knobs, run_knobs
from launcher.model.moe import MoE, moe_layers
from launcher.ops import experts as ex
from launcher.planner import build_options
from tests.conftest import run_for

COUNTS = [3, 0, 9, 8]  # an empty group, groups of unaligned sizes


def weights(dtype: torch.dtype, dim: int = 16, hidden: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(len(COUNTS), dim, hidden), (len(COUNTS), dim, hidden), (len(COUNTS), hidden, dim)]
    return [(torch.randn(s, generator=g) / 4).to(dtype).requires_grad_() for s in shapes]


def test_group_offsets_pad_each_group_to_eight_rows() -> None:
    offsets, rows, dest = ex.group_offsets(COUNTS, torch.device("cpu"))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [8, 8, 24, 32] and rows == 32
    assert dest.tolist() == [0, 1, 2, *range(8, 17), *range(24, 32)]
    offsets, rows, dest = ex.group_offsets([8, 0, 16], torch.device("cpu"))
    assert offsets.tolist() == [8, 8, 24] and rows == 24 and dest is None  # aligned: nothing moves


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("counts", [COUNTS, [8, 0, 16, 8]], ids=["padded", "aligned"])
def test_grouped_matches_the_loop_values_and_gradients(dtype: torch.dtype, tol: float, counts: list[int]) -> None:
    x = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    grad_out = torch.randn(sum(counts), 16).to(dtype)
    results = []
    for compute in (ex.loop_swiglu, lambda *a: ex.grouped_swiglu(*a, dtype=dtype)):
        w = weights(dtype)
        inputs = x.detach().clone().requires_grad_()
        out = compute(inputs, counts, *w)
        (out * grad_out).sum().backward()
        results.append([out, inputs.grad, *(t.grad for t in w)])
    for got, want in zip(*results):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert results[0][2][1].abs().sum() == 0, "an expert without tokens gets no gradient"


def moe_layer(impl: str) -> MoE:
    m = compose_config("+model=moe_tiny").model
    cfg = dataclasses.replace(m, moe=dataclasses.replace(m.moe, shared_experts=0))
    return moe_layers([initialized_model(cfg, 3, torch.device("cpu"), Knobs(expert_impl=impl))])[0]


def test_moe_layer_under_bf16_autocast_matches_the_loop() -> None:
    """The layer's grouped path in bf16 against the loop's bf16 autocast matmuls: outputs and every
    gradient within bf16 rounding."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    results = []
    for impl in ("loop", "grouped_mm"):
        layer = moe_layer(impl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        (y.float() * torch.linspace(-1, 1, 64)).sum().backward()
        results.append([y.float(), *(p.grad for p in layer.parameters())])
    for got, want in zip(results[1], results[0]):  # within 2% of each tensor's largest entry
        scale = want.abs().max()
        assert scale > 0 and (got - want).abs().max() <= 2e-2 * scale


def test_the_path_is_grouped_only_on_a_fast_kernel_in_bf16_with_aligned_widths(monkeypatch) -> None:
    cpu = torch.device("cpu")
    aligned, odd = (64, 32), (64, 36)
    assert ex.select_impl(*aligned, cpu, bf16=True) == "loop"  # no fast kernel on CPU
    monkeypatch.setattr(ex, "grouped_mm_kernel", lambda device: True)  # as on an H100/H200
    assert ex.select_impl(*aligned, cpu, bf16=True) == "grouped_mm"
    assert ex.select_impl(*aligned, cpu, bf16=False) == "loop"  # fp32: the loop's exact matmuls
    assert ex.select_impl(*odd, cpu, bf16=True) == "loop"  # 36 bf16 = 72 bytes: rows not 16-byte aligned


def test_the_run_builds_its_experts_on_the_path_it_picked(monkeypatch) -> None:
    """The run's knobs carry the pick into the constructors: every MoE layer's experts run on it."""
    cfg = compose_config("+model=moe_tiny", "dtype=bf16", "batch.micro=2", "batch.global=8")
    layout = from_config(cfg, 1)
    monkeypatch.setattr(ex, "grouped_mm_kernel", lambda device: True)  # as on an H100/H200
    knobs = run_knobs(cfg.model, build_options(cfg, layout), layout.microbatches, torch.device("cpu"))
    assert knobs.expert_impl == "grouped_mm" and knobs.aux_scale == 1 / 4  # 4 micro-batches of 2
    layers = moe_layers([meta_model(cfg.model, knobs)])
    assert {(m.experts.impl, m.aux_scale) for m in layers} == {("grouped_mm", 0.25)}


def test_the_summary_records_the_path(tmp_path) -> None:
    from launcher.train.loop import train
    from tests.conftest import tiny_config

    summary = train(run_for(tiny_config(tmp_path, "model=moe_tiny", "steps=1", "checkpoint.every=0")), tmp_path / "run")
    assert summary["expert_impl"] == "loop"
    assert "expert_impl" not in train(
        run_for(tiny_config(tmp_path, "steps=1", "checkpoint.every=0")), tmp_path / "dense"
    )


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_loop_node_is_the_chain_bitwise_and_saves_gate_and_up(autocast: bool) -> None:
    """Values and every gradient bitwise equal to autograd's chain (an expert without rows too); the
    node keeps its input rows, gate and up (2 hidden widths a row) where the chain keeps 4."""
    x = torch.randn(sum(COUNTS), 16, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(sum(COUNTS), 16)
    results, saved = [], []
    for compute in (ex.loop_swiglu, ex.node_swiglu):
        w, inputs, held = weights(torch.float32), x.clone().requires_grad_(), {}
        keep = {t.untyped_storage().data_ptr() for t in (*w, inputs)}

        def pack(t: torch.Tensor, held: dict = held, keep: set = keep) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in keep:  # activations only, each storage once
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = compute(inputs, COUNTS, *w)
        (out.float() * grad_out).sum().backward()
        results.append([out, inputs.grad, *(t.grad for t in w)])
        saved.append(sum(held.values()))
    for got, want in zip(*results):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elem, rows, hidden = 2 if autocast else 4, sum(COUNTS), 24
    cast = elem * rows * 16 if autocast else 0  # the rows in bf16 (autocast's cast), saved by both
    assert saved[1] == cast + 2 * elem * rows * hidden
    # the chain: 4 widths, and under autocast also its bf16 copies of each expert's weights and of the rows
    assert saved[0] >= cast + 4 * elem * rows * hidden and (autocast or saved[0] == 4 * elem * rows * hidden)


def test_zero_bubble_keeps_the_chain(tmp_path) -> None:
    """`split_weight_passes` turns the node off: a zero-bubble input pass would compute the weights' part too."""
    from launcher.parallel.pipeline import split_weight_passes

    layer = moe_layer("loop")
    x = torch.randn(8, 64, requires_grad=True)
    assert layer.experts(x, [8] + [0] * 7).grad_fn.name() == "ExpertLoopBackward"
    split_weight_passes(layer)
    assert layer.experts.split_weights and layer.experts(x, [8] + [0] * 7).grad_fn.name() == "CatBackward0"
