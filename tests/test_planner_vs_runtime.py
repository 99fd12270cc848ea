"""The planner's memory model against what the runtime holds (CPU, fp32, recompute=none).

Parameters: `rank_params` (and FSDP's shard of it) must equal, element for element, what the
parallel model holds on each rank: tp=1, pp=2 (untied and tied) in this process, tp=2 and FSDP
dp=2 in two gloo processes.

Activations: `layer_activation_bytes` against the bytes autograd saves for one block forward,
counted with saved-tensor hooks (parameters and the RoPE table excluded, each storage once).
How the `small` model's SwiGLU and GQA are counted: SwiGLU saves w1 x, w3 x, silu(w1 x) and their
product (4 f, as the planner says). GQA: SDPA runs with enable_gqa, so K and V are saved n_kv_heads
wide, as the planner counts them. nn.RMSNorm saves x * rstd (h) and rstd (1) besides its input, which
the planner counts too. The tests ask for exact equality, so a change on either side shows up here.
"""

from __future__ import annotations

import torch

from bench.planner_accuracy import (
    ACT_TOLERANCE,
    block_saved_bytes,
    resolved_config,
    single_process_memory,
    two_rank_worker,
)
from launcher.flops import head_dim
from launcher.layout import from_config
from launcher.model.transformer import Block, rope_tables
from launcher.planner.memory import layer_activation_bytes
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


def test_tp2_parameters_and_activations_exact():
    ranks = run(two_rank_worker, 2, SEQ, timeout=120)
    for r in ranks:
        for p in r["params"]:
            assert p["predicted"] == p["held"], p
    for r in ranks:
        act = r["act"]
        assert act["measured"] == act["predicted"], act["detail"]


def test_context_parallel_activations_exact():
    """cp=2: the all-gathered K and V (cp x the local ones) replace the local ones; the rest per token."""
    from bench.context import block_memory_worker

    for r in (block_memory_worker(0, 1, SEQ), run(block_memory_worker, 2, SEQ, timeout=120)[0]):
        assert r["measured"] == r["predicted"], (r["cp"], r["detail"])
