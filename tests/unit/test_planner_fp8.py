"""The planner under dtype=fp8 (launcher/planner/fp8.py): the time term exactly on a synthetic profile,
when fp8 is and is not predicted faster, its memory, `plan`'s dtype column and side-by-side table, the
JSON fields, `train dtype=auto` staying bf16, and the one-line refusal on hardware without FP8 units."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from bench.published_runs import make_cfg
from launcher import planner
from launcher.errors import LauncherError
from launcher.flops import GIB
from launcher.layout import Layout
from launcher.planner import efficiency
from launcher.planner.predict import predict
from launcher.planner.request import problem

# a synthetic FP8 device: bf16 at 100 TFLOP/s x 0.8, fp8 at 200 x 0.5 (1.25x), 1 TB/s of memory
SYNTHETIC = dict(peak_tflops=100.0, peak_tflops_fp8=200.0, matmul_efficiency=0.8, fp8_matmul_efficiency=0.5)


def pair(recipe: str = "tensorwise", model: str = "8b", **hardware):
    """(bf16, fp8) problems of `model` on one synthetic device, seq 4096."""
    hw = {**SYNTHETIC, "memory_bandwidth_gbs": 1000.0, **hardware}
    cfg = make_cfg(model, "h100_sxm", dtype="fp8", seq_len=4096)
    cfg.hardware = dataclasses.replace(cfg.hardware, **hw)
    cfg.fp8 = SimpleNamespace(recipe=recipe, emulate=False, min_features=1024)
    fp8 = problem(cfg, 1)
    return dataclasses.replace(fp8, fp8=None), fp8


def test_fp8_term_on_a_synthetic_profile_is_exact(monkeypatch):
    """8b (h 4096, 32 heads of 128, 8 KV heads, SwiGLU 14336), 32 blocks, 4096 tokens, wide GEMMs (G0 = 0):
    the blocks' linear FLOPs run 1.25x faster, and every converted element is cast at 7 bytes."""
    monkeypatch.setitem(efficiency.G0, "cuda", 0.0)
    bf16, fp8 = pair()
    lay = Layout()
    a, b = predict(bf16, lay).time, predict(fp8, lay).time
    h, q, kv, f, tokens, layers = 4096, 4096, 1024, 14336, 4096, 32
    # q, k, v, o, gate, down, up: each layer casts its own input
    # q, k, v, o, gate, down, up: each layer casts its own input
    shapes = ((h, q), (h, kv), (h, kv), (q, h), (h, f), (f, h), (h, f))
    params = sum(k * n for k, n in shapes)
    bf16_matmul_s = 6 * params * tokens * layers / (100e12 * 0.8)
    assert a.compute - b.compute == pytest.approx(bf16_matmul_s * (1 - 1 / 1.25), rel=1e-9)
    cast = 7 * layers * sum(tokens * (k + n) + k * n for k, n in shapes) / 1000e9
    assert b.fp8_cast == pytest.approx(cast, rel=1e-9) and a.fp8_cast == 0
    assert b.total == pytest.approx(a.total - (a.compute - b.compute) + cast, rel=1e-9)
    # FSDP over 8 with the float8 all-gather: each gather (forward, backward) casts the local eighth of a weight
    sharded = predict(fp8, Layout(dp_shard=8)).time.fp8_cast
    assert sharded == pytest.approx(7 * layers * sum(tokens * (k + n) + k * n / 4 for k, n in shapes) / 1000e9)


def test_fp8_is_faster_where_its_matmuls_dominate():
    bf16, fp8 = pair()
    for lay in (Layout(micro=1), Layout(micro=4), Layout(micro=2, recompute="full")):
        a, b = predict(bf16, lay), predict(fp8, lay)
        assert b.tokens_per_s > 1.1 * a.tokens_per_s, lay


def test_fp8_is_slower_where_the_casts_outweigh_the_faster_matmuls():
    """On a device with little memory bandwidth per FLOP the amax and cast passes cost more than the
    matmuls save: fp8 is predicted slower, by exactly the casts less the saving."""
    bf16, fp8 = pair(memory_bandwidth_gbs=50.0)
    a, b = predict(bf16, Layout()).time, predict(fp8, Layout()).time
    saved = a.compute - b.compute
    assert b.fp8_cast > saved > 0 and b.total > a.total


def test_rowwise_casts_more_than_tensorwise():
    tensorwise, rowwise = (predict(pair(r)[1], Layout()).time for r in ("tensorwise", "rowwise"))
    assert rowwise.fp8_cast == pytest.approx(tensorwise.fp8_cast * 10 / 7)
    assert rowwise.total > tensorwise.total


def test_fp8_memory_holds_the_weight_copies_and_scales():
    """No FSDP: one fp8 copy of each converted weight (rowwise: two) and their scales beside the bf16
    state; FSDP tensorwise gathers in fp8 (the gathered copy is the fp8 one): the scales alone."""
    params = 4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096  # one 8b block's converted weights
    for recipe, extra in (("tensorwise", 32 * (params + 7 * 4)), ("rowwise", None)):  # a scale per layer
        bf16, fp8 = pair(recipe)
        grown = predict(fp8, Layout()).memory.buffers - predict(bf16, Layout()).memory.buffers
        if extra is not None:
            assert grown == pytest.approx(extra)
        else:
            assert 2 * 32 * params < grown < 2 * 32 * params * 1.01
    bf16, fp8 = pair()
    fsdp = Layout(dp_shard=8)
    grown = predict(fp8, fsdp).memory.buffers - predict(bf16, fsdp).memory.buffers
    assert grown == pytest.approx(32 * 7 * 4)  # q, k, v, o, gate, up, down


def test_fp8_is_priced_only_on_the_layers_the_runtime_converts():
    """1b's wk and wv (2048 -> 512 features) stay bf16 under fp8.min_features=1024, as the runtime
    decides (precision.fp8_layer): the planner's fp8 weights are the others'."""
    from launcher.planner.fp8 import converted_params

    _, fp8 = pair(model="1b")
    h, f = 2048, 8192
    assert converted_params(fp8.fp8, fp8.model, 1) == h * h + h * h + 3 * h * f  # q, o and the MLP
    low = dataclasses.replace(fp8.fp8, min_features=16)
    assert converted_params(low, fp8.model, 1) == h * h + 2 * h * 512 + h * h + 3 * h * f


def test_fsdp_gathers_tensorwise_weights_in_fp8():
    """The float8 all-gather halves the converted weights' bytes (tensorwise); rowwise gathers bf16."""
    lay = Layout(dp_shard=8)
    bf16, tw = pair("tensorwise")
    _, rw = pair("rowwise")
    a, b, c = (predict(p, lay).time.dp_total for p in (bf16, tw, rw))
    assert b < 0.8 * a and c == pytest.approx(a)


def test_plan_ranks_what_train_runs_and_shows_fp8_as_the_option(capsys, monkeypatch):
    """dtype=auto trains bf16: `plan` ranks and budgets bf16 (a ranking of fp8 layouts priced a run
    `train` would not do), and shows layout #1 in fp8 beside it, labelled as the option."""
    monkeypatch.delenv("COLUMNS", raising=False)  # a log's width (pytest-xdist's workers say 80)
    cfg = make_cfg("8b", "h100_sxm", plan={"top": 40, "tokens": 1e12})
    planner.run_plan(cfg)
    out = capsys.readouterr().out
    table, side = out.split("layout #1 in bf16")
    assert "bf16" in table and "fp8" not in table  # at any width (a narrow one names the dtype above the rows)
    assert "(dtype=auto) and in fp8 (dtype=fp8)" in " ".join(side.split()) and "MFU fp8 peak" in side
    best = planner.resolve(dataclasses.replace(cfg, tp="auto", pp="auto", cp="auto"), 8)[1]
    assert best.time.fp8_cast == 0  # what train resolves: bf16


def test_plan_json_carries_the_dtype_and_the_fp8_peak_mfu(capsys):
    for dtype, fp8 in (("auto", False), ("fp8", True)):
        cfg = make_cfg("8b", "h100_sxm", dtype=dtype, plan={"format": "json", "top": 0})
        planner.run_plan(cfg)
        rows = json.loads(capsys.readouterr().out)
        assert {row["dtype"] for row in rows} == ({"fp8"} if fp8 else {"bf16"})
        for row in rows:
            if fp8:  # the same model FLOPs against twice the peak
                assert row["mfu_fp8_peak"] == pytest.approx(row["mfu"] * 989.0 / 1979.0)
            else:
                assert row["mfu_fp8_peak"] is None


def test_train_with_dtype_auto_stays_bf16_and_dtype_fp8_is_planned_in_fp8():
    cfg = make_cfg("8b", "h100_sxm", nodes=1)
    assert planner.resolve(cfg)[1].dtype == "bf16"
    fp8 = planner.resolve(dataclasses.replace(cfg, dtype="fp8"))[1]
    assert fp8.dtype == "fp8" and fp8.mfu_fp8_peak is not None


def test_fp8_on_hardware_without_fp8_units_is_one_line_naming_the_profile():
    cfg = make_cfg("8b", "a100", seq_len=4096, dtype="fp8")
    with pytest.raises(LauncherError) as err:
        planner.plan(cfg, 8)
    assert "a100" in str(err.value) and "fp8.emulate=true" in str(err.value) and "\n" not in str(err.value)


def test_emulated_fp8_predicts_no_speed_up():
    cfg = make_cfg("8b", "a100", seq_len=4096, dtype="fp8")
    cfg.fp8 = SimpleNamespace(recipe="tensorwise", emulate=True, min_features=1024)
    fp8 = problem(cfg, 8)
    bf16 = dataclasses.replace(fp8, fp8=None)
    lay = Layout(dp_shard=8)
    a, b = predict(bf16, lay), predict(fp8, lay)
    assert b.time.compute == pytest.approx(a.time.compute) and b.tokens_per_s <= a.tokens_per_s
    assert b.mfu_fp8_peak is None and b.memory.total / GIB > a.memory.total / GIB - 1e-9
