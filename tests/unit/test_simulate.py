"""`simulate=true` (launcher/simulate/): one rank per pipeline position stepped on fake tensors, its peak
memory per category beside the planner's; what it refuses; a host tensor meeting the rank's tensors is caught."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import launcher.simulate.step as step
from launcher.compat.fake_compat import CATEGORIES
from launcher.config.precision import autocast_for
from launcher.config.run import Run
from launcher.config.schema import compose_config
from launcher.errors import LauncherError
from launcher.launch.cli import run_of
from launcher.model.init import initialized_model
from launcher.model.knobs import run_knobs
from launcher.parallel.runner import Runner
from launcher.planner import resolve
from launcher.planner.predict import Problem
from launcher.planner.request import problem
from launcher.simulate import check, simulate
from launcher.simulate.report import balanced
from launcher.train.optim import build_optimizer
from tests.conftest import assert_bad_input, run_cli
from tests.unit.test_moe_balanced import VALUES_READ


def resolved(*overrides: str) -> tuple[Run, Problem]:
    """The Run `train OVERRIDES simulate=true` simulates, and the planner's problem for it."""
    cfg = compose_config("hardware.peak_tflops=1.0", "force=true", *overrides)  # a peak given: nothing calibrated
    layout, prediction, options = resolve(cfg)
    return run_of(cfg, layout, prediction, options), problem(cfg, layout.world_size)


def test_a_tensor_parallel_rank_holds_its_shards_and_adam_moments() -> None:
    run, prob = resolved("+model=small", "tp=2", "seq_len=64")
    peak = step.rank_peak(run, 0)
    # fp32 shards, two fp32 moments of each and a step count per parameter: DTensor's sharding propagation
    # runs its ops on global-shape fake tensors (the whole model's state at once), which must not count
    assert peak["optimizer"] == pytest.approx(2 * peak["params"], rel=1e-4)
    assert peak["activations"] > 0 and peak["total"] >= sum(v for k, v in peak.items() if k != "total")
    result = simulate(run, prob, out=lambda _: None)
    sim, plan = result["ranks"][0]["simulated_gib"], result["ranks"][0]["predicted_gib"]
    assert sim["params"] == pytest.approx(plan["params"], rel=0.05)
    assert sim["optimizer"] == pytest.approx(plan["optimizer"], rel=0.05)


@pytest.mark.parametrize("model", ["small", "moe_tiny"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_fake_step_holds_what_the_real_step_holds(dtype: str, model: str) -> None:
    """One process: the same tracker over the same step on real tensors measures the same bytes per category (a
    mixture of experts routed as simulated: balanced, on both)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    run, _ = resolved(f"+model={model}", f"dtype={dtype}", "seq_len=64")
    run = balanced(run)
    fake, device = step.rank_peak(run, 0), torch.device("cpu")
    model = initialized_model(run.model, 0, device, run_knobs(run.model, run.options, 1, device))
    runner = Runner(model, run.layout.micro, autocast_for(run.options.precision, device))
    optimizer, _ = build_optimizer([model], run.optim, 2)
    batch = [torch.randint(0, run.model.vocab_size, (run.layout.micro, 64)) for _ in range(2)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(2):  # as simulated: AdamW's first update on zero gradients, then a step
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
            runner.forward_backward(*batch)
            runner.clip_grad_norm(run.optim.grad_clip)
    real = {key.value: nbytes for key, nbytes in tracker.get_tracker_snapshot("peak")[device].items() if key != "Total"}
    assert {CATEGORIES[k]: v for k, v in real.items()} == {k: v for k, v in fake.items() if k != "total"}


def test_every_pipeline_position_runs_its_schedule(tmp_path: Path) -> None:
    run, prob = resolved("+model=small", "pp=2", "tp=2", "dp=2", "seq_len=64")
    lines: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = simulate(run, prob, out=lines.append, json_path=tmp_path / "simulate.json")
    assert not [w for w in seen if "returned a view tensor" in str(w.message)]  # the last stage's logits (tensor.py)
    assert [r["pp"] for r in result["ranks"]] == [0, 1]
    assert [r["rank"] for r in result["ranks"]] == [0, 4]  # dp 0 / tp 0 of each position
    assert json.loads((tmp_path / "simulate.json").read_text())["ranks"] == result["ranks"]
    assert any("tracker cannot see" in line for line in lines)
    for row in result["ranks"]:  # FSDP shards over dp=2; each position's stage holds activations
        assert row["simulated_gib"]["working"] > 0 and row["simulated_gib"]["params"] > 0


def test_a_position_measures_the_same_after_another() -> None:
    """Positions run one after another in this process, each on its own fake group: nothing cached by DTensor
    may reach for the last one's groups (sequence parallelism did), nor change what a position measures."""
    run, _ = resolved("+model=small", "tp=2", "pp=2", "sequence_parallel=true", "seq_len=64")
    step.rank_peak(run, 0)
    after = step.rank_peak(run, 1)
    assert after == step.rank_peak(run, 1)


def test_a_one_f_one_b_rank_holds_fewer_microbatches_than_gpipe() -> None:
    schedules = [resolved("+model=small", "pp=2", f"pp_schedule={s}", "microbatches=4") for s in ("1f1b", "gpipe")]
    first = [step.rank_peak(run, 0)["activations"] for run, _ in schedules]
    assert first[0] < first[1]  # rank 0 of 1F1B: pp - 0 = 2 in flight, GPipe: all 4


def test_one_f_one_b_skips_only_the_steady_pairs_that_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """1F1B's steady state cut to `STEADY_PAIRS` (backward, forward) pairs measures what the whole schedule does
    at every position (FSDP's gradients kept unsynced until the last backward); with no steady pair, it does not.
    Before the tracker's hooks were removed per microbatch (`forward_hooks`), the last position grew by two hidden
    states a microbatch."""
    import launcher.simulate.pipeline as pipeline

    run, _ = resolved("+model=small", "pp=2", "dp=2", "pp_schedule=1f1b", "microbatches=6", "seq_len=64")
    forwards = [{mb for kind, mb, _ in pipeline.rank_actions(run.layout, r) if kind == "F"} for r in (0, 1)]
    assert [len(f) for f in forwards] == [4, 3]  # of 6 microbatches: warmup 2 (1), then two steady pairs
    kept = [step.rank_peak(run, r) for r in (0, 1)]
    monkeypatch.setattr(pipeline, "STEADY_PAIRS", 6)
    assert [step.rank_peak(run, r) for r in (0, 1)] == kept
    monkeypatch.setattr(pipeline, "STEADY_PAIRS", 0)
    assert [step.rank_peak(run, r) for r in (0, 1)] != kept


def test_a_host_tensor_meeting_the_ranks_tensors_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU-side cousin of a CPU tensor meeting CUDA activations: a tensor made outside the runtime's
    allocation (here one a forward hook keeps from import time) cannot silently join the step."""
    run, _ = resolved("+model=tiny", "tp=2", "seq_len=64")
    kept = torch.ones(())  # a real tensor, as a module-level constant would be
    build = step.build_runner

    def with_mistake(*args: object) -> object:
        runner = build(*args)
        runner.parts[0].norm.register_forward_hook(lambda _m, _i, out: out * kept)
        return runner

    monkeypatch.setattr(step, "build_runner", with_mistake)
    with pytest.raises(Exception, match="FakeTensor"):
        step.rank_peak(run, 0)


def test_what_fake_tensors_cannot_represent_is_refused() -> None:
    run, _ = resolved("+model=moe_tiny", "ep=2")
    check(run)  # a mixture of experts: simulated with its routing balanced
    run, _ = resolved("+model=tiny")
    check(run)  # a dense model on plain causal attention: simulated
    with pytest.raises(LauncherError, match="data.document_mask reads token values"):
        check(replace(run, data=replace(run.data, document_mask=True)))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [(("+model=tiny", "tp=3"), "tp"), (("+model=tiny", "hardware=tpu_v5p"), "a TPU profile's step runs under XLA")],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], expected: str) -> None:
    result = run_cli("train", *args, "simulate=true", "hardware.peak_tflops=1.0", cwd=tmp_path)
    assert_bad_input(result, expected, tmp_path)


def test_a_mixture_of_experts_is_simulated_with_its_routing_balanced(tmp_path: Path) -> None:
    """Expert parallelism with tensor parallelism and pipelining: every position steps, its peak beside the
    planner's, routed round-robin (fake tensors have no values: routed by the router, the step cannot run)."""
    layout = ("ep=2", "tp=2", "pp=2", "batch.micro=2", "batch.global=8", "seq_len=64")
    # moe_tiny widened (no time on fake tensors) so that its shards read to 1% in the JSON's 4 decimals of GiB
    run, prob = resolved("+model=moe_tiny", "model.dim=512", "model.moe.expert_ffn_dim=1024", *layout)
    lines: list[str] = []
    result = simulate(run, prob, out=lines.append)
    assert result["routing"] == "balanced" and any(line.startswith("routing: balanced") for line in lines)
    assert [r["pp"] for r in result["ranks"]] == [0, 1]
    for row in result["ranks"]:
        sim, plan = row["simulated_gib"], row["predicted_gib"]
        # each stage's shards (4 of 8 experts at ep=2) as the planner counts them; the parameters at the peak add
        # an FSDP unit's gathered weights
        assert sim["optimizer"] == pytest.approx(plan["optimizer"], rel=0.01) and sim["params"] >= plan["params"]
        assert sim["working"] > 0 and f"{sim['peak']:>6.2f}/{plan['peak']:<6.2f}" in "\n".join(lines)
    with pytest.raises(VALUES_READ):
        step.rank_peak(run, 0)  # as configured: the router's top k, counted by bincount


def test_8b_at_tp_8_the_planner_is_above_the_simulation_within_30_percent() -> None:
    run, prob = resolved("+model=8b", "hardware=h100_sxm", "nodes=1", "tp=8")
    row = simulate(run, prob, out=lambda _: None)["ranks"][0]
    sim, plan = row["simulated_gib"], row["predicted_gib"]
    assert run.options.precision == "autocast_bf16"  # the GPU run's precision, simulated on the CPU
    assert sim["params"] == pytest.approx(plan["params"], rel=0.01)  # 1/8 of every matrix, fp32
    # the step peaks in the update: the tracker counts its working tensors with the moments
    assert sim["optimizer"] == pytest.approx(plan["optimizer"], rel=0.05)
    # the planner is never under (the step peaks at forward's end, before any gradient: the planner counts a set,
    # and a bf16 copy of every weight where autocast caches only the row-parallel ones), and within 30%
    assert sim["peak"] <= plan["peak"] <= 1.3 * sim["peak"]


def test_a_cuda_profile_s_rmsnorm_keeps_what_cuda_s_fused_kernel_keeps() -> None:
    """On a GPU profile the simulated RMSNorm keeps its input, weight and fp32 rstd, as CUDA's fused kernel does
    (the CPU's composite keeps fp32 copies besides); its output is the composite's; the planner counts the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launcher.planner.activations import norm_stats_bytes
    from launcher.simulate.kernels import cuda_kernels

    x, norm, composite = torch.randn(2, 8, 64), torch.nn.RMSNorm(64, eps=1e-6), torch.nn.functional.rms_norm
    with cuda_kernels("cuda"):
        assert torch.nn.functional.rms_norm is not composite
        assert torch.equal(norm(x), composite(x, [64], norm.weight, 1e-6))
        with FakeTensorMode(allow_non_fake_inputs=True):
            saved: list[torch.Tensor] = []
            fx = torch.empty(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = norm.to(torch.bfloat16)(fx)
            out.sum().backward()
            assert fx.grad.shape == fx.shape and norm.weight.grad.shape == (64,)
    assert torch.nn.functional.rms_norm is composite  # restored
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((2, 8, 64), torch.bfloat16),
        ((64,), torch.bfloat16),
        ((2, 8, 1), torch.float32),
    ]
    m = resolved("+model=small")[0].model
    assert norm_stats_bytes(m, 2, fused_norm=True) == 2 * 4  # two norms' rstd a token; the inputs apart
    assert norm_stats_bytes(m, 2) == 2 * 2 * (m.dim + 1)  # the composite's x * rstd and rstd


@pytest.mark.parametrize(
    "args",
    [
        ("+model=small", "tp=8", "sequence_parallel=true", "model.n_heads=8", "model.n_kv_heads=8"),
        ("+model=small", "pp=4", "dp=2", "pp_schedule=1f1b", "microbatches=8"),
        ("+model=moe_tiny", "ep=8", "dp_shard=8"),
    ],
    ids=["tp8-sp", "pp4-fsdp2", "ep8"],
)
def test_layouts_no_gpu_check_can_run_simulate(args: tuple[str, ...]) -> None:
    """The layouts the one-GPU check cannot run (tp=8, pp=4 over FSDP, ep=8) step on fake tensors, every position,
    each holding its shards, its optimizer state and a working set."""
    run, prob = resolved(*args, "seq_len=64")
    result = simulate(run, prob, out=lambda _: None)
    assert len(result["ranks"]) == run.layout.pp
    for row in result["ranks"]:
        sim, plan = row["simulated_gib"], row["predicted_gib"]
        assert sim["params"] > 0 and sim["working"] > 0
        assert sim["optimizer"] == pytest.approx(plan["optimizer"], rel=0.05)


def test_context_parallel_is_simulated_on_a_ranks_share_of_each_sequence() -> None:
    """cp=2 x pp=2 on a GPU profile: a rank runs its two chunks of each sequence (what its loader hands it, and a
    later stage receives: full-length tensors do not reach attention's shapes) and gathers K and V; the CPU's chunk
    masks, held where a GPU's flash kernel takes torch's causal bias, are named."""
    whole, _ = resolved("+model=small", "hardware=h100_sxm", "nodes=1", "pp=2", "dp_shard=4", "seq_len=256")
    run, prob = resolved("+model=small", "hardware=h100_sxm", "nodes=1", "cp=2", "pp=2", "dp_shard=2", "seq_len=256")
    check(run)
    lines: list[str] = []
    result = simulate(run, prob, out=lines.append)
    assert [r["pp"] for r in result["ranks"]] == [0, 1]
    sim, plan = result["ranks"][0]["simulated_gib"], result["ranks"][0]["predicted_gib"]
    assert 0 < sim["working"] < simulate(whole, prob, out=lambda _: None)["ranks"][0]["simulated_gib"]["working"]
    assert plan["peak"] == pytest.approx(sim["peak"], rel=0.1)
    assert any(line.startswith("not simulated:") and "cp's causal bias" in line for line in lines)


def test_fp8_is_simulated_with_torchao_s_float8_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype=fp8 builds torchao's Float8Linear layers (the casts run on fake tensors: their fp8 copies are held as a
    GPU holds them), and the planner's fp8 weight copies are counted beside the simulation's."""
    float8: set[str] = set()

    def spy(*args: Any, **kwargs: Any) -> Runner:
        runner = build_runner(*args, **kwargs)
        float8.update(type(m).__name__ for part in runner.parts for m in part.modules() if "Float8" in type(m).__name__)
        return runner

    build_runner = step.build_runner
    monkeypatch.setattr(step, "build_runner", spy)
    run, prob = resolved("+model=small", "hardware=h100_sxm", "nodes=1", "dtype=fp8", "fp8.min_features=64")
    assert run.options.fp8 is not None and prob.fp8 is not None
    lines: list[str] = []
    result = simulate(run, prob, out=lines.append)
    assert float8 == {"Float8Linear"}
    assert "fp8 (tensorwise) + bf16 (FSDP mixed precision)" in lines[0]  # the header names what runs
    sim, plan = result["ranks"][0]["simulated_gib"], result["ranks"][0]["predicted_gib"]
    assert plan["peak"] == pytest.approx(sim["peak"], rel=0.15)
