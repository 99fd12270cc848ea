"""The planner's memory terms beyond parameters and activations: FSDP's gathered units and
reduce-scatter copy, the fused AdamW and chunked loss terms, the fixed overhead; and the CPU workers' allocator
setting that makes peak RSS measure the run (bench memory has the measured figures)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from launcher.config.schema import compose_config
from launcher.flops import FLOP_PER_BYTE, GIB, device_flop_per_byte, head_dim, loss_chunk_rows, loss_weight_bytes
from launcher.layout import Layout
from launcher.planner import memory
from launcher.planner.predict import predict
from launcher.planner.request import problem
from launcher.planner.timeline import in_flight
from launcher.train.allocator import allocator_mode
from tests.unit.test_planner import make_cfg


def test_fsdp_holds_the_root_unit_two_blocks_the_outputs_gradient_and_a_blocks_copy():
    m = make_cfg("125m").model  # tied embeddings: the root unit is the 50304 x 768 matrix and the final norm
    lay = Layout(dp_shard=2, micro=1)
    layer = memory.counts(m).per_layer
    root = memory.rank_params(m, lay, 0) - m.n_layers * layer
    assert root == m.vocab_size * m.dim + m.dim
    for elem, kind in ((4, "cpu"), (2, "cuda")):
        got = memory.rank_memory(m, 128, lay, elem, kind, 0).buffers
        assert got == elem * (root + 2 * layer) + elem * m.vocab_size * m.dim + memory.GRAD_BYTES * layer


def test_fused_adamw_has_no_temporary_and_the_chunked_loss_no_logits():
    """One process: the update adds only the two moments; the loss keeps d loss / d h and one chunk of
    fp32 logits (ops/loss.py: 469 of the 16384 tokens on a CPU, the runtime's rule), not tokens x
    vocab; under tp one chunk of its vocabulary shard (parallel/vocab.py), never the whole shard."""
    m = make_cfg("125m").model
    lay = Layout(micro=8)
    one = memory.rank_memory(m, 2048, lay, 4, "cpu", 0)
    assert one.optimizer == memory.ADAM_BYTES * memory.rank_params(m, lay, 0)
    assert loss_chunk_rows(8 * 2048, m.vocab_size, FLOP_PER_BYTE["cpu"]) == 469
    assert one.logits == 8 * 2048 * m.dim * 4 + 469 * m.vocab_size * 4
    tp = memory.rank_memory(m, 2048, Layout(tp=2, micro=8), 4, "cpu", 0)
    rows = loss_chunk_rows(8 * 2048, m.vocab_size // 2, FLOP_PER_BYTE["cpu"])
    assert rows == 469 and tp.logits == 8 * 2048 * m.dim * 4 + rows * m.vocab_size // 2 * 4


def test_the_chunked_loss_on_an_h200_moves_the_output_weight_a_few_times_and_the_planner_counts_it():
    """`1b` on one H200 at 8 x 2048 tokens (the gpu-check run): chunks of 2048 tokens, not 32, so the
    output weight and its fp32 gradient move 8 times a step (34 GB, 7 ms at 4.8 TB/s), not 512 times
    (2.2 TB, 0.45 s: more than the rest of the step); the planner's step time has that term and its
    memory the chunk: fp32 logits and their bf16 copy."""
    cfg = compose_config("+model=1b", "hardware=h200", "hardware.devices_per_node=1", "seq_len=2048", "batch.micro=8")
    m, hw = cfg.model, cfg.hardware
    ratio = device_flop_per_byte(hw.kind, hw.peak_tflops, hw.memory_bandwidth_gbs)
    tokens, weight = 8 * 2048, m.vocab_size * m.dim
    moved = loss_weight_bytes(tokens, m.vocab_size, m.dim, ratio)
    matmul_s = 6 * tokens * weight / (hw.peak_tflops * 1e12)  # the loss's three matmuls at peak
    assert moved / (hw.memory_bandwidth_gbs * 1e9) <= 0.3 * matmul_s
    assert moved == 8 * 16 * weight
    prob = problem(cfg, 1)
    pred = predict(prob, Layout(micro=8))
    assert pred.time.loss == moved / (hw.memory_bandwidth_gbs * 1e9)
    assert pred.time.total == pytest.approx(pred.time.compute + pred.time.loss)
    assert pred.memory.logits == tokens * m.dim * 2 + 2048 * m.vocab_size * (4 + 2)


def test_cpu_overhead_is_the_worker_process():
    m = make_cfg("small").model
    assert memory.rank_memory(m, 128, Layout(), 4, "cpu", 0).overhead == pytest.approx(0.25 * GIB)


FREED = """
import sys
import torch
from launcher.train.allocator import set_cpu_allocator

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

assert set_cpu_allocator("lean")
torch.empty(16 << 18).fill_(1)  # a 16 MiB block freed: glibc raises its mmap threshold to 16 MiB
before = rss()
blocks = [torch.ones(2 << 20) for _ in range(40)]  # 8 MiB each
keep = torch.ones(1 << 10)  # above them in the heap
del blocks
print(rss() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_workers_return_freed_tensors_to_the_system():
    """Blocks of 4 MiB and more are mmapped, and freeing one returns it (bench memory: a 125m FSDP rank
    peaked at 2.9 GiB of RSS without the setting, 1.9 with it, its live memory)."""
    out = subprocess.run([sys.executable, "-c", FREED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 40  # MiB retained of the 320 freed


REUSED = """
import resource
import sys
import torch
from launcher.train.allocator import set_cpu_allocator

if sys.argv[1] != "glibc":
    assert set_cpu_allocator(sys.argv[1])
for _ in range(10):  # 64 MiB blocks: glibc's heap settles (its first few reuses still grow it)
    torch.ones(1 << 24)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(1 << 24)  # as a layer's activations: allocated, written, freed
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_fast_allocator_reuses_freed_blocks_without_faulting_their_pages_in():
    """glibc mmaps a 64 MiB block and unmaps it when freed: each new one faults its 16K pages in again
    (the peer shape's QKV and gate+up outputs; ~450K faults a step on one process)."""
    faults = {}
    for mode in ("glibc", "fast"):
        out = subprocess.run([sys.executable, "-c", REUSED, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        faults[mode] = int(out.stdout.split()[-1])
    assert faults["glibc"] > 10 * 16_000 * 0.9, faults  # every block's pages, every time
    assert faults["fast"] < 1_000, faults


@pytest.mark.parametrize(
    ("setting", "steps", "mode"),
    [("auto", 0, "lean"), ("auto", 5, "fast"), ("lean", 5, "lean"), ("fast", 0, "fast")],
)
def test_the_lean_allocator_is_for_memory_checks_unless_asked(setting: str, steps: int, mode: str) -> None:
    assert allocator_mode(setting, steps) == mode


def test_tensor_parallel_embedding_backward_builds_the_whole_table_gradient():
    m = make_cfg("1b").model
    lay = Layout(tp=4, sequence_parallel=True)
    first, plain = memory.rank_memory(m, 128, lay, 4, "cpu", 0), memory.rank_memory(m, 128, Layout(), 4, "cpu", 0)
    table = memory.GRAD_BYTES * m.vocab_size * m.dim * (1 + 1 / 4)
    # one microbatch: the gradients and the table at backward's end, beyond the activations (freed by then)
    grads = memory.GRAD_BYTES * memory.rank_params(m, lay, 0)
    assert first.grads == pytest.approx(grads + table - (first.activations + first.logits))
    grads = memory.GRAD_BYTES * memory.rank_params(m, Layout(), 0)
    assert plain.grads == pytest.approx(max(0, grads - (plain.activations + plain.logits)))
    two = memory.rank_memory(m, 128, replace(lay, microbatches=2), 4, "cpu", 0)  # accumulating: all of them
    extra = table - (two.activations + two.logits)
    assert two.grads == pytest.approx(memory.GRAD_BYTES * memory.rank_params(m, lay, 0) + max(0, extra))
    # pipelined: at the end of a microbatch's backward the other microbatches' activations are still in flight
    # (the 405b's first stage at tp=8 pp=16: -13% of the simulated peak when they were counted freed)
    piped = replace(lay, pp=2, microbatches=4)
    p0 = memory.rank_memory(m, 128, piped, 4, "cpu", 0)
    freed = p0.activations / in_flight(piped, 0)
    assert in_flight(piped, 0) == 2 and freed < table
    assert p0.grads == pytest.approx(memory.GRAD_BYTES * memory.rank_params(m, piped, 0) + table - freed)
    # under FSDP's bf16 policy the table is bf16; with a pipeline FSDP accumulates it whole, in fp32, unsynced
    # (the simulation of 70b tp=8 pp=4 dp=2: a 3.9 GiB fp32 table from `to_accumulated_grad_if_needed`)
    bf16 = memory.embedding_table_bytes(m, replace(lay, dp_shard=2), 2)
    assert bf16 == m.vocab_size * m.dim * 2 * (1 + 1 / 4)
    accumulated = memory.embedding_table_bytes(m, replace(piped, dp_shard=2), 2)
    assert accumulated == m.vocab_size * m.dim * (2 + 4 * (1 - 1 / 4)) > bf16


def test_a_device_snapshot_and_replica_groups_buckets_are_counted():
    """guard.snapshot=device (under rollback) keeps each rank's weights and Adam moments a second time
    on the device, 12 bytes a parameter; ft.replicas' cross-group all-reduce two 64 MiB buckets. Both
    count toward `fits`, as the runtime holds them."""
    lay = Layout(dp_shard=8)
    base = predict(problem(make_cfg(model="8b", hardware="h100_sxm"), 8), lay).memory
    snap_cfg = make_cfg(model="8b", hardware="h100_sxm")
    snap_cfg.guard.spike, snap_cfg.guard.snapshot = "rollback", "device"
    snap = predict(problem(snap_cfg, 8), lay).memory
    assert snap.held == pytest.approx(12 * 8_030_261_248 / 8, rel=1e-3) == base.params + base.optimizer
    assert snap.total - base.total == pytest.approx(snap.held)
    snap_cfg.guard.snapshot = "host"
    assert predict(problem(snap_cfg, 8), lay).memory.held == 0
    ft_cfg = make_cfg(model="8b", hardware="h100_sxm")
    ft_cfg.ft.replicas = 2
    assert predict(problem(ft_cfg, 8), lay).memory.held == 2 * 64 * 2**20


def docs_cfg(*keys: str) -> Any:
    """1b on a CPU at seq 2048, micro 4, with document masks (`data.document_mask`) or without."""
    return compose_config("+model=1b", "hardware=cpu", "seq_len=2048", "batch.micro=4", *keys)


def test_document_masks_count_their_dense_mask_for_each_microbatch_in_flight():
    """On a CPU each forward builds a dense fp32 (micro, 1, seq, seq) mask that its backward reads (1b at seq
    2048, micro 4: 64 MiB), with the RoPE angles at each token's position in its document (4 MiB); a pipeline's
    first rank holds both for each microbatch in flight. On CUDA FlexAttention's block mask: kilobytes."""
    m, seq, micro = docs_cfg().model, 2048, 4
    mask, rope = micro * seq * seq * 4, micro * seq * 2 * head_dim(m) * 4
    assert (mask, rope) == (64 * 2**20, 4 * 2**20)
    lay = Layout(micro=micro)
    base = predict(problem(docs_cfg(), 1), lay).memory
    docs = predict(problem(docs_cfg("data.document_mask=true"), 1), lay).memory
    assert docs.activations - base.activations == docs.total - base.total == mask + rope
    pipe = Layout(pp=2, micro=micro, microbatches=8)
    assert in_flight(pipe, 0) == 2
    plain, masked = (memory.rank_memory(m, seq, pipe, 4, "cpu", 0, documents=d) for d in (False, True))
    assert masked.activations - plain.activations == 2 * (mask + rope)
    h100 = [
        predict(problem(docs_cfg("hardware=h100_sxm", *d), 1), lay).memory for d in ([], ["data.document_mask=true"])
    ]
    blocks = seq // memory.FLEX_BLOCK
    assert h100[1].total - h100[0].total == micro * 16 * blocks * (blocks + 1) + rope  # 69 KiB of block mask
    assert problem(docs_cfg(), 1).documents is False


def test_a_tiny_forward_with_document_masks_holds_what_the_planner_adds():
    """`tiny` at micro 2, seq 256 on this CPU: what a forward keeps for backward (bench/recompute.py's count
    of the storages ops made that are alive after it) grows by the planner's document bytes, within 1% (the
    positions within each document, 8 bytes a token, are not counted)."""
    import gc

    import torch

    from bench.recompute import HeldBytes, _ptrs
    from launcher.model.documents import document_ids
    from launcher.model.init import initialized_model

    cfg = compose_config("+model=tiny", "hardware=cpu", "seq_len=256", "batch.micro=2")
    model = initialized_model(cfg.model, 0, torch.device("cpu"))
    tokens = torch.randint(1, cfg.model.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    tokens[:, [50, 180]] = 0
    held = []
    for documents in (None, document_ids(tokens, 0)):
        meter = HeldBytes()
        with meter:
            loss = model(tokens, tokens, documents)
        gc.collect()
        held.append(meter.alive(_ptrs([*model.parameters(), *model.buffers(), loss])))
        loss.backward()
    predicted = memory.document_bytes(cfg.model, 256, Layout(micro=2), "cpu", 0)
    assert predicted == 2 * 256 * 256 * 4 + 2 * 256 * 2 * head_dim(cfg.model) * 4
    assert predicted <= held[1] - held[0] <= 1.01 * predicted
