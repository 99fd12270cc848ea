"""The planner's memory model against what the runtime holds (CPU, fp32, recompute=none).

Parameters: `rank_params` (and FSDP's shard of it) must equal, element for element, what the
parallel model holds on each rank: tp=1, pp=2 (untied and tied) in this process, tp=2 and FSDP
dp=2 in two gloo processes.

Activations: `layer_activation_bytes` against the bytes autograd saves for one block forward,
counted with saved-tensor hooks (parameters and the RoPE table excluded, each storage once).
How the `small` model's SwiGLU and GQA are counted: SwiGLU saves the fused product [w1 x | w3 x]
and silu(w1 x) x w3 x (3 f, as the planner says). GQA: SDPA runs with enable_gqa, so K and V are saved n_kv_heads
wide, as the planner counts them. nn.RMSNorm saves x * rstd (h) and rstd (1) besides its input, which
the planner counts too. The tests ask for exact equality, so a change on either side shows up here.

Recompute modes (selective, full, recompute_layers): saved-tensor hooks do not see what a checkpoint
keeps (its input, the selective policy's cache), so bench/recompute.py counts the storages ops made in
forward that are still alive after it; with recompute=none that count equals the hooks' (checked).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bench.planner_accuracy import (
    ACT_TOLERANCE,
    block_saved_bytes,
    resolved_config,
    single_process_memory,
    two_rank_worker,
)
from bench.recompute import Stage, config, held_bytes, memory_rows, tp2_memory_worker
from launcher.compat.torch_compat import fake_store
from launcher.config.layout_keys import from_config
from launcher.config.schema import compose_config
from launcher.flops import head_dim
from launcher.layout import build_mesh
from launcher.model.attention import rope_tables
from launcher.model.init import initialized_model
from launcher.model.transformer import Block
from launcher.parallel import build_runner
from launcher.parallel.pipeline import split_weight_passes
from launcher.parallel.recompute import apply_recompute
from launcher.planner import build_options
from launcher.planner.activations import layer_activation_bytes, stream_bytes
from tests.dist import run

SEQ = 128


def test_parameters_per_rank_match_single_process():
    mem = single_process_memory(SEQ)
    for p in mem["params"]:
        assert p["predicted"] == p["held"], p


def test_block_activation_bytes_within_15_percent():
    cfg = resolved_config(1, 1, 1, SEQ, 1)
    m = cfg.model
    assert m.mlp == "swiglu" and m.n_kv_heads < m.n_heads  # the shapes this test is about
    torch.manual_seed(0)
    block = Block(m)
    rope = rope_tables(head_dim(m), m.max_seq_len, m.rope_theta, torch.device("cpu"))
    saved, detail = block_saved_bytes(block, rope, torch.randn(1, SEQ, m.dim, requires_grad=True))
    predicted = layer_activation_bytes(m, SEQ, from_config(cfg, 1), 4)[0] * SEQ
    assert abs(predicted / saved - 1) <= ACT_TOLERANCE, (predicted, saved, detail)
    assert saved == predicted, detail


@pytest.mark.parametrize("zero_bubble", [False, True], ids=["expert-node", "zero-bubble-chain"])
def test_moe_block_activation_bytes_exact(zero_bubble: bool):
    """A MoE block (moe_tiny: routed experts, a shared one, GQA): the routed rows, the routing's scores,
    weights, gates and indices, the experts' gate and up (their node), or 4 widths (autograd's chain,
    which zero-bubble schedules keep) as the planner counts them."""
    pipelined = ("pp=2", "pp_schedule=interleaved_zb", "batch.global=2") if zero_bubble else ()
    cfg = compose_config("+model=moe_tiny", "hardware=cpu", f"seq_len={SEQ}", "batch.micro=1", *pipelined)
    m = cfg.model
    block = initialized_model(m, 0, torch.device("cpu")).layers["0"]
    if zero_bubble:
        split_weight_passes(block)
    rope = rope_tables(head_dim(m), m.max_seq_len, m.rope_theta, torch.device("cpu"))
    x = torch.randn(1, SEQ, m.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    saved, detail = block_saved_bytes(block, rope, x)
    layout = from_config(cfg, 2 if zero_bubble else 1)
    assert layout.zero_bubble == zero_bubble
    assert saved == layer_activation_bytes(m, SEQ, layout, 4)[0] * SEQ, detail


@pytest.mark.slow
def test_tp2_parameters_and_activations_exact():
    ranks = run(two_rank_worker, 2, SEQ, timeout=120)
    for r in ranks:
        for p in r["params"]:
            assert p["predicted"] == p["held"], p
    for r in ranks:
        act = r["act"]
        assert act["measured"] == act["predicted"], act["detail"]


@pytest.mark.slow
def test_held_bytes_equal_saved_tensor_hooks_without_recompute():
    cfg = resolved_config(1, 1, 1, SEQ, 1)
    m = cfg.model
    rope = rope_tables(head_dim(m), m.max_seq_len, m.rope_theta, torch.device("cpu"))
    counts = []
    for count in (block_saved_bytes, held_bytes):
        torch.manual_seed(0)
        block = Block(m)
        x = torch.randn(1, SEQ, m.dim, requires_grad=True)
        counts.append(count(block, rope, x)[0] if count is block_saved_bytes else count([block], rope, x))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_autocast_saved_bytes_exact(recompute: str):
    """Under bf16 autocast (one process, pure TP, DDP) the residual stream stays fp32: a block keeps exactly the
    planner's bytes per token (`stream_bytes`: fp32 norm inputs and statistics, the projections' fp32 input,
    RoPE's tables cast; the fp32 input under recompute), beside the bf16 copies of wo and w2 that autocast's
    weight cache holds until the forward's region ends (the planner's working copy of the weights, a buffer)."""
    cfg = compose_config(
        "+model=small", "hardware=cpu", f"seq_len={SEQ}", "batch.micro=1", "dtype=bf16", f"recompute={recompute}"
    )
    m, lay = cfg.model, from_config(cfg, 1)
    assert stream_bytes(2, "cpu", lay) == 4 and stream_bytes(2, "cuda", replace(lay, dp_shard=2)) == 2
    rope = rope_tables(head_dim(m), m.max_seq_len, m.rope_theta, torch.device("cpu"))
    torch.manual_seed(0)
    stage = Stage([Block(m)])
    apply_recompute(stage, lay)
    x = torch.randn(1, SEQ, m.dim, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        held = held_bytes(list(stage.layers.values()), rope, x)
    block = stage.layers["0"]
    casts = 2 * (block.attention.wo.weight.numel() + block.feed_forward.w2.weight.numel())
    assert held == layer_activation_bytes(m, SEQ, lay, 2, True, stream_bytes(2, "cpu", lay))[0] * SEQ + casts


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_saved_bytes_exact_with_sequence_parallelism_and_autocast(dtype: str, sp: bool, fake_tp2: None):
    """One block of the tp=2 model as the worker builds it (rank 0 on the fake group: shapes are what count), every
    recompute policy: under sequence parallelism each projection saves its all-gathered input (whole on the rank),
    under autocast the residual stream is fp32 and the tensor-parallel hook casts the projections' input first."""
    for recompute in ("none", "selective", "full"):
        cfg = config(SEQ, 2, f"recompute={recompute}", f"dtype={dtype}", f"sequence_parallel={sp}")
        lay = from_config(cfg, 2)
        model = build_runner(cfg.model, lay, build_mesh(lay), build_options(cfg, lay), torch.device("cpu")).parts[0]
        torch.manual_seed(0)
        x = torch.randn(1, SEQ // 2 if sp else SEQ, cfg.model.dim, requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            held = held_bytes([model.layers["0"]], model.rope, x)
        block = model.layers["0"]
        weights = block.attention.wo.weight.to_local().numel() + block.feed_forward.w2.weight.to_local().numel()
        elem = 2 if dtype == "bf16" else 4
        casts = 2 * weights if dtype == "bf16" else 0  # autocast's weight cache (see the test above)
        saved = layer_activation_bytes(cfg.model, SEQ, lay, elem, True, stream_bytes(elem, "cpu", lay))[0]
        assert held == saved * SEQ + casts, recompute


@pytest.fixture
def fake_tp2() -> Iterator[None]:
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_recompute_modes_saved_bytes_exact():
    """none, selective, full, and recompute_layers=1 of a 2-block stage under none and selective."""
    for row in memory_rows(SEQ):
        assert row["predicted"] == row["held"], row


@pytest.mark.slow
def test_tp2_recompute_modes_saved_bytes_exact():
    """Under tp=2 the selective policy saves each row-parallel matmul's all-reduced result, not its
    partial sum: 3 h replicated, the rest sharded."""
    for row in run(tp2_memory_worker, 2, SEQ, timeout=180)[0]:
        assert row["predicted"] == row["held"], row


def zero_worker(rank: int, world: int) -> dict[str, int]:
    """Parameter elements held unsharded after one forward, under ZeRO-3 and ZeRO-2 (FSDP dp=2)."""
    from torch.distributed.tensor import DTensor

    from launcher.layout import build_mesh
    from launcher.parallel import build_runner
    from launcher.planner.memory import rank_params

    out = {}
    for reshard in ("always", "never"):
        cfg = resolved_config(1, 1, 2, SEQ, 2, f"fsdp.reshard_after_forward={reshard}")
        lay = from_config(cfg, world)
        model = build_runner(cfg.model, lay, build_mesh(lay), build_options(cfg, lay), torch.device("cpu")).parts[0]
        model(torch.zeros(1, SEQ, dtype=torch.long))
        out[reshard] = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
        out["stage"] = rank_params(cfg.model, lay, 0)
    return out


@pytest.mark.slow
def test_zero2_holds_the_stage_gathered_after_forward():
    """The planner's ZeRO-2 term: every parameter of the stage gathered at the end of forward (ZeRO-3:
    none left gathered)."""
    for held in run(zero_worker, 2, timeout=180):
        assert held["never"] == held["stage"] and held["always"] == 0, held


@pytest.mark.slow
def test_context_parallel_activations_exact():
    """cp=2: the all-gathered K and V (cp x the local ones) replace the local ones; the rest per token."""
    from bench.context import block_memory_worker

    for r in (block_memory_worker(0, 1, SEQ), run(block_memory_worker, 2, SEQ, timeout=120)[0]):
        assert r["measured"] == r["predicted"], (r["cp"], r["detail"])


@pytest.mark.slow
def test_fsdp_holds_sharded_gradients_between_microbatches():
    """dp_shard=2, 4 micro-batches (gloo, fp32): the bytes held at the start of micro-batches 2-4 over
    those at the first are the planner's gradients, the sharded ones, within the loss scalars (FSDP's
    no-sync accumulation would hold the unsharded ones: twice that)."""
    from bench.fsdp_accumulation import config, held_between_microbatches

    for ranks in run(held_between_microbatches, 2, config("tiny", 32, 4), ("reduce-scatter",), 1, timeout=180):
        r = ranks["reduce-scatter"]
        assert len(r["held"]) == 3, r
        for held in r["held"]:
            assert 0 <= held - r["planned"] <= 64, (held, r["planned"])
