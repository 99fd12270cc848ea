"""The layout planner: its models against formulas and published runs, its search, its errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bench.planner_speed import search_405b
from bench.published_runs import make_cfg
from launcher import planner
from launcher.config.schema import CONF_DIR
from launcher.errors import LauncherError
from launcher.flops import num_params
from launcher.hardware.machine import Level
from launcher.layout import Layout
from launcher.planner import comm, memory
from launcher.planner.predict import predict
from launcher.planner.request import problem

CONF = Path(CONF_DIR)


def fixed(tp, pp, dp, shard, micro, glob, **kw):
    batch = {"micro": micro, "global": glob}
    return dict(tp=tp, pp=pp, dp=dp, dp_shard=shard, dp_replicate=dp // shard, batch=batch, **kw)


# ---------------------------------------------------------------- the bandwidth claim and search size


@pytest.mark.parametrize(
    "hardware, per_node, pp1_within_5pct",
    [("h100_sxm", 8, False), ("gb200_nvl72", 4, True), ("tpu_v5p", 4, True)],
)
def test_405b_on_16k_devices_needs_pipelining_only_on_8_gpu_nodes(hardware, per_node, pp1_within_5pct):
    """16M-token batch (2048 x 8192): is the best layout without pipelining within 5% of the best
    1F1B-family layout? (Zero-bubble schedules shrink the bubble 3x and make pipelining win on
    NVL72 too: test_zero_bubble_narrows_the_pipeline_bubble.)"""
    res = search_405b(hardware, per_node)
    best = min(p.time.total for p in res.ranked if not p.layout.zero_bubble)
    best_pp1 = min(p.time.total for p in res.ranked if p.layout.pp == 1)
    assert (best_pp1 <= 1.05 * best) is pp1_within_5pct, (hardware, best_pp1 / best)


def test_full_405b_search_on_16384_gpus_stays_bounded():
    """What keeps `plan` fast (`python -m bench planner_speed` times it): cp=auto tries only powers of two
    that leave each rank MIN_CP_TOKENS, so 16,384 GPUs enumerate a few hundred valid layouts, not the
    thousands every divisor would give; many of them fit."""
    res = search_405b("h100_sxm", 8)
    assert 150 < res.tried <= 400 and len(res.ranked) > 50  # (fewer than pp microbatches: not runnable)


def test_planning_for_a_gpu_profile_does_not_import_torch():
    code = (
        "import sys\n"
        "from tests.unit.test_planner import make_cfg\n"
        "from launcher import planner\n"
        "batch = {'micro': 'auto', 'global': 64}\n"
        "auto = dict(tp='auto', pp='auto', pp_schedule='auto', recompute='auto')\n"
        "cfg = make_cfg('70b', nodes=4, seq_len=4096, batch=batch, plan={'format': 'json'}, **auto)\n"
        "planner.run_plan(cfg)\n"
        "planner.resolve(cfg, 32)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)[0]["tp"] >= 1


# ---------------------------------------------------------------- memory model


def gpt_layout(t=1, sp=False, recompute="none"):
    return Layout(tp=t, recompute=recompute, sequence_parallel=sp)


def test_activations_reproduce_korthikanti_for_gpt():
    m = make_cfg("gpt2-8.3b").model
    m.dropout = 0.1  # the paper's GPT: fp16 activations and dropout, attention unfused
    h, a, s = m.dim, m.n_heads, 1024
    stats = 2 * 2 * 2  # torch's two LayerNorms also save mean and rstd (fp16): the paper counts inputs only

    def saved(**kw):
        return memory.layer_activation_bytes(m, s, gpt_layout(**kw), 2, fused_attention=False)[0]

    assert saved() == pytest.approx(h * (34 + 5 * a * s / h) + stats)
    assert saved(t=8) == pytest.approx(h * (10 + 24 / 8 + 5 * a * s / (h * 8)) + stats)
    # with sequence parallelism the QKV and MLP inputs (2 h each of the 34 h) stay whole on every rank: Megatron
    # re-gathers them in backward, DTensor's plan saves the gathered tensor (test_planner_vs_runtime.py measures it)
    assert saved(t=8, sp=True) == pytest.approx(h / 8 * (30 + 5 * a * s / h) + 4 * h + stats / 8)
    # op-level selective keeps the input, QKV, attention output (+ fp32 log-sum-exp per head), the
    # MLP's up projection and the two row-parallel results: 22 h, not Megatron's 34 h (which keeps
    # every activation but the attention core's)
    assert saved(t=8, sp=True, recompute="selective") == pytest.approx((22 * h + 4 * a) / 8)
    assert saved(recompute="full") == pytest.approx(2 * h)


def test_activations_swiglu_gqa_and_fused_attention():
    m = make_cfg("8b").model  # h 4096, 32 heads / 8 kv heads (h_kv 1024), SwiGLU f 14336, no dropout
    h, f = 4096, 14336
    expected = 2 * (4 * h) + 2 * (2 * h + 2 * 1024) + 3 * 2 * f + 4 * 32  # + fp32 log-sum-exp per head
    expected += 2 * 2 * (h + 1)  # the two RMSNorms' saved x * rstd and rstd (bf16)
    assert memory.layer_activation_bytes(m, 8192, gpt_layout(), 2)[0] == pytest.approx(expected)


def test_parameters_per_rank_add_up_to_the_model():
    m = make_cfg("8b").model
    for pp, v in [(1, 1), (4, 1), (4, 2), (3, 1)]:
        sched = "interleaved_1f1b" if v > 1 else "1f1b"
        lay = Layout(pp=pp, microbatches=8, schedule=sched, virtual_stages=v)
        assert sum(memory.rank_params(m, lay, r) for r in range(pp)) == num_params(m)
    lay = Layout(tp=2)
    assert 2 * memory.rank_params(m, lay, 0) == pytest.approx(num_params(m), rel=1e-4)  # norms replicated


def test_in_flight_microbatches_by_schedule():
    base = dict(tp=1, pp=4, dp_shard=1, dp_replicate=1, micro=1, microbatches=16)
    assert memory.in_flight(Layout(**base, schedule="gpipe"), 0) == 16
    assert memory.in_flight(Layout(**base, schedule="1f1b"), 0) == 4
    assert memory.in_flight(Layout(**base, schedule="1f1b"), 3) == 1
    inter = memory.in_flight(Layout(**base, schedule="interleaved_1f1b", virtual_stages=2), 0)
    assert inter == pytest.approx(4 * (1 + 3 / (4 * 2)))  # Korthikanti: p (1 + (p - 1)/(p v))


def test_fsdp_shards_state_and_recompute_frees_activations():
    cfg = make_cfg("8b", seq_len=8192)
    prob = problem(cfg, 8)

    def mem(**kw):
        lay = Layout(**{**dict(tp=1, pp=1, dp_shard=8, dp_replicate=1, micro=1, microbatches=1), **kw})
        return predict(prob, lay).memory

    ddp, fsdp = mem(dp_shard=1, dp_replicate=8), mem()
    assert ddp.optimizer == pytest.approx(8 * fsdp.optimizer)
    assert ddp.params + ddp.grads + ddp.optimizer == pytest.approx(16 * num_params(cfg.model))  # DDP's buckets
    # FSDP, one microbatch: the gradients meet no activation (none at forward's end; backward frees them as it
    # writes them); two microbatches: the first one's meet the second's activations
    sharded = 4 * num_params(cfg.model) / 8
    assert fsdp.grads == pytest.approx(max(0, sharded - fsdp.activations - fsdp.logits)) == 0
    assert mem(microbatches=2).grads == pytest.approx(sharded)
    assert mem(recompute="full").activations < mem().activations / 10


# ---------------------------------------------------------------- time model


def test_ring_all_reduce_on_one_level():
    lv = (Level("nvlink", 8, 100e9, 1e-6), Level("ib", 1 << 20, 10e9, 5e-6))
    assert comm.all_reduce(lv, 1e9, 1, 8) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9 + 2 * 6 * 1e-6)
    assert comm.split(lv, 8, 16) == ((lv[1], 16),)
    assert comm.split(lv, 1, 32) == ((lv[0], 8), (lv[1], 4))
    # 8 ranks per node share the network hierarchically: 1/8 of the bytes cross it
    assert comm.all_reduce(lv, 1e9, 1, 32) < comm.all_reduce(lv, 1e9, 8, 32) / 4


def test_a_small_message_costs_more_per_byte_where_the_link_is_calibrated_by_size():
    # gloo-like rows: (bytes, all-reduce, all-gather, reduce-scatter, all-to-all bytes/s)
    rows = ((2.0**18, 0.2e9, 0.1e9, 0.1e9, 0.1e9), (2.0**24, 1.6e9, 0.8e9, 0.4e9, 1.2e9))
    sized = (Level("shm", 64, 1.6e9, 300e-6, 0.8e9, 0.4e9, 1.2e9, by_size=rows),)
    flat = (Level("shm", 64, 1.6e9, 300e-6, 0.8e9, 0.4e9, 1.2e9),)
    for collective in (comm.all_reduce, comm.all_gather, comm.reduce_scatter, comm.all_to_all):
        small, big = collective(sized, 2.0**18, 1, 2), collective(sized, 2.0**24, 1, 2)
        assert small / 2**18 > 2 * big / 2**24  # per byte, well beyond what the latency adds
        assert big == pytest.approx(collective(flat, 2.0**24, 1, 2))  # the largest row: the single rates
    # halfway in log size (2 MiB): the geometric mean of the two rows' rates; outside them, the nearest
    assert sized[0].rate("gather", 2.0**21) == pytest.approx((0.1e9 * 0.8e9) ** 0.5)
    assert sized[0].rate("ring", 1.0) == 0.2e9 and sized[0].rate("ring", 2.0**30) == 1.6e9
    assert comm.all_gather(sized, 2.0**21, 1, 2) == pytest.approx(2**20 / (0.1e9 * 0.8e9) ** 0.5 + 300e-6)
    # FSDP moves a rank's 16 MiB in 8 units of 2 MiB: each at 2 MiB's rate (the latency once)
    assert comm.all_gather(sized, 2.0**24, 1, 2, 8) == pytest.approx(2**23 / (0.1e9 * 0.8e9) ** 0.5 + 300e-6)
    assert comm.all_gather(flat, 2.0**24, 1, 2, 8) == comm.all_gather(flat, 2.0**24, 1, 2)  # no size: unchanged
    # time-sliced workers scale every row
    assert sized[0].time_sliced(0.5).rate("all_to_all", 2.0**18) == pytest.approx(0.05e9)


def test_fsdp_host_copies_only_where_the_profile_has_a_host_copy_time():
    import dataclasses

    from launcher.planner.cost import fsdp_copies

    cfg = make_cfg("small", "cpu", seq_len=256)
    base = dataclasses.replace(problem(make_cfg("8b", seq_len=4096), 8), model=cfg.model, seq=256, elem=4)
    assert base.machine.host_copy_time == 0.0  # accelerators: device copies at HBM speed
    layout = Layout(dp_shard=2, micro=2)
    gpu = predict(base, layout).time
    copy = dataclasses.replace(base, machine=dataclasses.replace(base.machine, host_copy_time=1e-9))
    t = predict(copy, layout).time
    params = memory.rank_params(cfg.model, layout, 0)
    # ZeRO-3: two gathers (elem 4) and a reduce-scatter (fp32), each copying 1 + 1/2 of the unit
    assert t.dp_total - gpu.dp_total == pytest.approx(1e-9 * 1.5 * (2 * 4 + 4) * params)
    assert fsdp_copies(copy.machine, 1e6, 1, "gather") == pytest.approx(1e-3)  # one rank: one copy out
    assert fsdp_copies(copy.machine, 1e6, 1, "scatter") == pytest.approx(2e-3)  # cat in, copy out


def test_bubble_shrinks_with_microbatches_and_virtual_stages():
    cfg = make_cfg("8b", seq_len=4096)
    prob = problem(cfg, 8)
    one = predict(prob, Layout(pp=8, microbatches=8)).time
    more = predict(prob, Layout(pp=8, microbatches=32)).time
    inter = predict(prob, Layout(pp=8, microbatches=8, schedule="interleaved_1f1b", virtual_stages=2)).time
    assert one.pp_bubble / one.compute == pytest.approx(7 / 8, rel=0.1)
    assert more.pp_bubble / more.compute == pytest.approx(7 / 32, rel=0.1)
    assert inter.pp_bubble == pytest.approx(one.pp_bubble / 2, rel=0.1)


def test_block_host_time_and_optimizer_step_where_the_host_is_the_device():
    import dataclasses

    cfg = make_cfg("small", "cpu", seq_len=256)
    base = dataclasses.replace(problem(make_cfg("8b", seq_len=4096), 8), model=cfg.model, seq=256, elem=4)
    assert base.machine.block_overhead == 0.0  # accelerators: the host runs ahead
    gpu = predict(base, Layout(pp=2, microbatches=4)).time
    assert gpu.host == 0.0
    cpu = dataclasses.replace(base, machine=dataclasses.replace(base.machine, block_overhead=1e-3))
    t = predict(cpu, Layout(pp=2, microbatches=4)).time
    # the busiest rank holds 2 of the 4 blocks and one end (embedding or output): 2.5 blocks, 4 microbatches
    assert t.host == pytest.approx(4 * 2.5e-3)
    assert t.total - gpu.total == pytest.approx(t.host * (1 + 1 / 4))  # and the bubble's one slot
    updates = dataclasses.replace(base, machine=dataclasses.replace(base.machine, optimizer_time=1e-9))
    t = predict(updates, Layout(pp=2, microbatches=4)).time
    assert t.optimizer == pytest.approx(1e-9 * memory.rank_params(cfg.model, Layout(pp=2, microbatches=4), 1))


def test_dp_traffic_hides_behind_compute_on_fast_links():
    cfg = make_cfg("8b", seq_len=4096)
    t = predict(problem(cfg, 8), Layout(dp_replicate=8, micro=4)).time  # DDP inside one node
    assert t.dp_total > 0 and t.dp_exposed < 0.5 * t.dp_total


# ---------------------------------------------------------------- interface


def test_run_plan_json_is_ranked_and_has_the_keys(capsys):
    cfg = make_cfg("8b", nodes=2, seq_len=4096, batch={"micro": "auto", "global": 64}, tp="auto", pp="auto",
                   pp_schedule="auto", recompute="auto", plan={"format": "json", "top": 5})  # fmt: skip
    planner.run_plan(cfg)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 5
    keys = {"tp", "pp", "dp", "microbatch", "schedule", "recompute", "memory_gib", "step_time_s"}
    keys |= {"tokens_per_s", "mfu", "bottleneck"}
    assert keys <= rows[0].keys()
    assert [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows), reverse=True)
    assert all(r["tp"] * r["pp"] * r["dp"] == 16 and r["memory_gib"] <= 74.5 for r in rows)


def test_run_plan_table_and_constraints(capsys):
    cfg = make_cfg("70b", nodes=4, seq_len=4096, batch={"micro": "auto", "global": 128}, tp=8, pp="auto",
                   pp_schedule="auto", recompute="auto", plan={"top": 3})  # fmt: skip
    planner.run_plan(cfg)
    out = capsys.readouterr().out
    assert "MFU" in out and "bottleneck" in out and "70b on 32 x h100_sxm" in out


def test_resolve_fills_autos_with_the_best_layout():
    cfg = make_cfg("70b", nodes=4, seq_len=4096, batch={"micro": "auto", "global": 128}, tp="auto", pp="auto",
                   pp_schedule="auto", recompute="auto")  # fmt: skip
    best, prediction, options = planner.resolve(cfg, 32)
    assert cfg.tp == "auto" and prediction.layout == best == planner.plan(cfg, 32)[1].ranked[0].layout
    assert best.world_size == 32 and best.global_batch == 128 and best.recompute in ("none", "selective", "full")
    pinned = make_cfg("70b", nodes=4, seq_len=4096, batch={"micro": best.micro, "global": 128},
                      **{k: v for k, v in best.settings().items() if "." not in k})  # fmt: skip
    assert planner.resolve(pinned, 32) == (best, prediction, options)  # the same layout given by hand: the same run
    pred = prediction.as_dict()
    json.dumps(pred)
    assert pred["fits"] and pred["memory_gib"] <= 74.5
    for key in ("compute", "tp_comm", "pp_bubble", "dp_exposed"):
        assert key in pred["time_s"]
    for key in ("params", "activations"):
        assert key in pred["memory"]


def test_check_refuses_what_cannot_fit_unless_forced():
    cfg = make_cfg("70b", seq_len=8192, **fixed(8, 1, 1, 1, 4, 4))
    with pytest.raises(LauncherError, match=r"predicted .* GiB .* hardware.memory_gib=74.5"):
        planner.resolve(cfg, 8)
    cfg.force = True
    assert planner.resolve(cfg, 8)[1].fits is False


# ---------------------------------------------------------------- bad input: one line naming the key


def one_line_error(cfg, world=None, match=""):
    with pytest.raises(LauncherError, match=match) as err:
        planner.resolve(cfg, world) if world else planner.run_plan(cfg)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_input_errors():
    one_line_error(make_cfg("8b", nodes=2, tp=3), match=r"world size 16 is not divisible by tp\*pp=3\*1")
    odd = make_cfg("8b", nodes=1, tp=1, pp=1, batch={"micro": 1, "global": 7})
    one_line_error(odd, match=r"batch.global=7")
    msg = one_line_error(make_cfg("405b", nodes=1, seq_len=8192, tp="auto", pp="auto", recompute="auto",
                                  batch={"micro": "auto", "global": 8}), match=r"fits no layout")  # fmt: skip
    assert "GiB per device" in msg and "memory_gib=74.5" in msg
    bad_hw = make_cfg("8b")
    bad_hw.hardware.kind = "abacus"
    one_line_error(bad_hw, match=r"hardware.kind=abacus: choose one of cpu, cuda, tpu")
    one_line_error(make_cfg("8b", tp=1, sequence_parallel=True), match=r"sequence_parallel=true needs tensor par")
    one_line_error(make_cfg("8b", plan={"format": "xml"}), match=r"plan.format")


def test_a_run_measures_mfu_against_the_peak_the_planner_predicts_with(monkeypatch):
    """4 workers of 1 thread on 2 cores each get half a core: the planner's peak; the run's MFU read
    the whole core's, so measured and predicted MFU disagreed 2x while tokens/s agreed."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cfg = make_cfg("tiny", "cpu", tp=2, dp=2, threads=1)
    cfg.hardware.peak_tflops = 0.1
    _, prediction, options = planner.resolve(cfg)
    assert options.peak_flops == pytest.approx(problem(cfg, 4).machine.peak_flops) == pytest.approx(0.05e12)


def test_cpu_profile_is_calibrated_through_resolve_hardware(monkeypatch):
    import launcher.hardware.resolve as hardware

    def fake(hw, threads, cache_dir, alone=False):
        links = [dict(name=x.name, size=x.size, bandwidth_gbs=2.0, latency_us=50.0) for x in hw.links]
        measured = {"peak_tflops": 0.1, "host_overhead_us": 1000.0, "links": links}
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(type(hw)), measured))

    monkeypatch.setattr(hardware, "resolve_hardware", fake)
    cfg = make_cfg("small", "cpu", seq_len=256, tp="auto", pp="auto", batch={"micro": 8, "global": 16})
    prob = problem(cfg, 2)
    assert prob.machine.peak_flops == 0.1e12 and prob.machine.levels[0].bandwidth == 2e9  # measured: as is
    prediction = planner.resolve(cfg, 2)[1]
    pred = prediction.as_dict()
    assert pred["step_time_s"] > 0 and pred["memory_gib"] < 16 and pred["world"] == 2
    assert pred["memory_gib"] == round(prediction.memory.total / 2**30, 3)  # GiB, not GB


def test_plan_yaml_composes_with_the_schema():
    from hydra import compose, initialize_config_dir

    import launcher.config.schema  # noqa: F401  (registers base_train)

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose(config_name="plan", overrides=["+model=8b", "nodes=2", "tp=4", "seq_len=2048"])
    cfg = OmegaConf.to_object(raw)
    assert cfg.tp == 4 and cfg.pp == "auto" and cfg.hardware.name == "h100_sxm" and cfg.plan.explore
    _, res = planner.plan(cfg, 16, explore=True)
    assert all(p.layout.tp == 4 and p.layout.sequence_parallel for p in res.ranked)


# ---------------------------------------------------------------- recompute layers and ZeRO-2


def test_partial_recompute_lies_between_none_and_full():
    cfg = make_cfg("8b", seq_len=8192)
    prob = problem(cfg, 8)
    base = dict(tp=1, pp=1, dp_shard=8, dp_replicate=1, micro=1, microbatches=1)

    def pred(**kw):
        return predict(prob, Layout(**{**base, **kw}))

    none, full = pred(), pred(recompute="full")
    acts = [pred(recompute_layers=n).memory.activations for n in (8, 16, 31)]
    times = [pred(recompute_layers=n).time.compute for n in (8, 16, 31)]
    assert none.memory.activations > acts[0] > acts[1] > acts[2] > full.memory.activations
    assert none.time.compute < times[0] < times[1] < times[2] < full.time.compute
    # a full block costs 4/3 of its FLOPs: 16 of 32 blocks cost half of full recompute's extra
    assert times[1] - none.time.compute == pytest.approx((full.time.compute - none.time.compute) / 2)
    sel = pred(recompute="selective")  # no matmul repeated: a few percent, far less memory
    assert sel.memory.activations < 0.75 * none.memory.activations
    assert 1.0 < sel.time.compute / none.time.compute < 1.1


def test_search_takes_the_smallest_recompute_layers_that_fit():
    cfg = make_cfg("8b", seq_len=8192, **fixed(1, 1, 8, 8, 1, 8), recompute="none", recompute_layers="auto")
    cfg.hardware.memory_gib = 48.0
    lay = planner.resolve(cfg, 8)[0]
    assert lay.recompute == "none" and 0 < lay.recompute_layers < 32
    prob = problem(cfg, 8)
    below = predict(prob, Layout(**{**lay.__dict__, "recompute_layers": lay.recompute_layers - 1}))
    assert not below.fits and planner.resolve(cfg, 8)[1].fits


def test_zero2_holds_gathered_parameters_and_gathers_once():
    cfg = make_cfg("8b", seq_len=4096)
    prob = problem(cfg, 64)
    base = dict(tp=1, pp=1, dp_shard=64, dp_replicate=1, micro=1, microbatches=4)
    zero3, zero2 = (predict(prob, Layout(**base, reshard=r)) for r in ("always", "never"))
    layer = memory.counts(cfg.model).per_layer  # ZeRO-3 frees all blocks but two after their forward
    assert zero2.memory.buffers - zero3.memory.buffers == 2 * (cfg.model.n_layers - 2) * layer
    assert zero2.memory.optimizer == zero3.memory.optimizer and zero2.memory.grads == zero3.memory.grads
    assert zero2.time.dp_total < zero3.time.dp_total  # one gather per microbatch instead of two
    assert Layout(pp=2).reshard_after_forward is False and Layout().reshard_after_forward is True


class Terminal:
    """A terminal of 120 columns, as rich sees one (a file that is a tty, and COLUMNS)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_the_ranking_reads_whole_in_a_120_column_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under 200 columns the table keeps the columns a choice rests on, the layout in one cell: no
    number cut to `68…` (the whole table needed ~220 columns); a log file still gets every column."""
    from launcher.planner.report import to_table

    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("TERM", "dumb")  # no colour codes in what is read back
    auto = dict.fromkeys(("tp", "pp", "cp", "dp", "dp_shard", "dp_replicate", "pp_schedule", "recompute"), "auto")
    cfg = make_cfg(
        "70b", nodes=16, seq_len=8192, batch={"global": 512, "micro": "auto"}, recompute_layers="auto", **auto
    )
    ranked = planner.plan(cfg, 128)[1].ranked[:3]
    term = Terminal()
    to_table(ranked, ["best 3"], term)
    term.text = re.sub(r"\x1b\[[0-9;]*m", "", term.text)  # the colours a terminal gets
    lines = term.text.splitlines()
    assert max(len(line) for line in lines) <= 120 and "…" not in term.text, term.text
    assert shutil.get_terminal_size().columns == 120, shutil.get_terminal_size()
    best = ranked[0]
    for cell in ("layout", f"{best.layout.micro} x {best.layout.microbatches}", f"{best.memory.total / 2**30:.1f}"):
        assert cell in term.text, cell
    assert best.bottleneck.split()[0] in term.text and f"{best.mfu:.1%}" in term.text
