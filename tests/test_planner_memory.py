"""The planner's memory terms beyond parameters and activations: FSDP's gathered units and
reduce-scatter copy, the foreach AdamW temporary, the fixed overhead; and the CPU workers' allocator
setting that makes peak RSS measure the run (bench memory has the measured figures)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.flops import GIB
from launcher.layout import Layout
from launcher.planner import memory
from tests.test_planner import make_cfg


def test_fsdp_holds_the_root_unit_two_blocks_the_outputs_gradient_and_a_blocks_copy():
    m = make_cfg("125m").model  # tied embeddings: the root unit is the 50304 x 768 matrix and the final norm
    lay = Layout(dp_shard=2, micro=1)
    layer = memory.counts(m).per_layer
    root = memory.rank_params(m, lay, 0) - m.n_layers * layer
    assert root == m.vocab_size * m.dim + m.dim
    for elem, kind in ((4, "cpu"), (2, "cuda")):
        got = memory.rank_memory(m, 128, lay, elem, kind, 0).buffers
        assert got == elem * (root + 2 * layer) + elem * m.vocab_size * m.dim + memory.GRAD_BYTES * layer


def test_foreach_adamw_temporary_is_counted_where_the_update_is_not_fused():
    m = make_cfg("125m").model
    lay = Layout(micro=1)
    cpu, cuda = (memory.rank_memory(m, 128, lay, 4, kind, 0) for kind in ("cpu", "cuda"))
    params = memory.rank_params(m, lay, 0)
    transient = cpu.activations + cpu.logits + cpu.buffers
    assert cuda.optimizer == memory.ADAM_BYTES * params
    assert cpu.optimizer == memory.ADAM_BYTES * params + memory.ADAM_STEP_BYTES * params - transient
    many = memory.rank_memory(m, 2048, Layout(micro=8), 4, "cpu", 0)  # activations larger than the temporary
    assert many.optimizer == memory.ADAM_BYTES * params


def test_cpu_overhead_is_the_worker_process():
    m = make_cfg("small").model
    assert memory.rank_memory(m, 128, Layout(), 4, "cpu", 0).overhead == pytest.approx(0.35 * GIB)


FREED = """
import sys
import torch
from launcher.train.fit import return_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

assert return_freed_memory()
torch.empty(16 << 18).fill_(1)  # a 16 MiB block freed: glibc raises its mmap threshold to 16 MiB
before = rss()
blocks = [torch.ones(2 << 20) for _ in range(40)]  # 8 MiB each
keep = torch.ones(1 << 10)  # above them in the heap
del blocks
print(rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_workers_return_freed_tensors_to_the_system():
    """Blocks of 4 MiB and more are mmapped, and freeing one returns it (bench memory: a 125m FSDP rank
    peaked at 2.9 GiB of RSS without the setting, 1.9 with it, its live memory)."""
    out = subprocess.run([sys.executable, "-c", FREED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 40  # MiB retained of the 320 freed


def test_tensor_parallel_embedding_backward_builds_the_whole_table_gradient():
    m = make_cfg("1b").model
    lay = Layout(tp=4, sequence_parallel=True)
    first, plain = memory.rank_memory(m, 128, lay, 4, "cpu", 0), memory.rank_memory(m, 128, Layout(), 4, "cpu", 0)
    table = memory.GRAD_BYTES * m.vocab_size * m.dim
    extra = table * (1 + 1 / 4) - (first.activations + first.logits)  # the activations are freed by then
    assert first.grads == pytest.approx(memory.GRAD_BYTES * memory.rank_params(m, lay, 0) + extra)
    assert plain.grads == memory.GRAD_BYTES * memory.rank_params(m, Layout(), 0)
