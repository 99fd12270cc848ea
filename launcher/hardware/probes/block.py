"""The CPU's non-matmul width H0 (launcher/planner/efficiency.py): the model width at which a block's
work that is not matmul (norms, RoPE, softmax, SwiGLU's product, residuals; attention's kernel, slower
per FLOP than a GEMM, is counted with it) takes as long as the block's matmuls.

On an accelerator H0 follows the device's FLOP per byte of memory. A CPU's GEMM speed against the rest
moves with the host it runs on: this project's machine ran 1024^3 GEMMs at about 200 GFLOP/s on one
thread when H0 = 180 was fitted, and at 85-100 on a later day, when the same blocks gave H0 = 60-100.
So it is measured, with the GEMM rate in the same window: the `small` model's blocks (h 256, SwiGLU,
GQA 8/4) forward and backward at PROBE_BATCH x PROBE_SEQ tokens, their median time less the block host
time (launcher/hardware/probes/host.py), over the time their FLOPs take at the median GEMM rate, is 1 + H0 / h.
"""

from __future__ import annotations

import statistics

from launcher.config.model import ModelConfig
from launcher.flops import blocks_flops_per_token, head_dim
from launcher.hardware.probes.cache import Probe, measure
from launcher.hardware.probes.gemm import GEMM_N, gemm_rates
from launcher.hardware.probes.harness import median_seconds, torch_threads
from launcher.hardware.probes.host import block_overhead_us, block_probe

PROBE = ModelConfig(name="probe", n_layers=2)  # the schema's default model: `small`'s blocks
PROBE_BATCH, PROBE_SEQ = 2, 256
# The blocks' code, in the cache key: a cached H0 measured other blocks. 2: SwiGLU and RoPE as one node
# each (launcher/ops/pointwise.py): H0 here 106 -> 74 at 1 thread, 137 -> 104 at 2 (probes vary ~20%)
BLOCKS = 2


def measure_nonmatmul_width(threads: int, host_s: float, seconds: float = 1.5) -> float:
    """H0 at `threads` threads (the module docstring); `host_s`: the host seconds of one block."""
    import torch

    from launcher.model.attention import rope_tables
    from launcher.model.transformer import Block

    with torch_threads(threads):
        torch.manual_seed(0)
        blocks = [Block(PROBE) for _ in range(PROBE.n_layers)]
        rope = rope_tables(head_dim(PROBE), PROBE_SEQ, PROBE.rope_theta, torch.device("cpu"))
        x = torch.randn(PROBE_BATCH, PROBE_SEQ, PROBE.dim)

        def step() -> None:
            h = x.requires_grad_()
            for block in blocks:
                h = block(h, rope)
            h.sum().backward()

        block_s = median_seconds(step, seconds, warmup=3) / PROBE.n_layers - host_s
        gemm = statistics.median(next(gemm_rates(GEMM_N, seconds / 2, 1, pause=0.0)))
    matmul_s = blocks_flops_per_token(PROBE, PROBE_SEQ) / PROBE.n_layers * PROBE_BATCH * PROBE_SEQ / gemm
    return max(0.0, PROBE.dim * (block_s / matmul_s - 1.0))


def width_probe(threads: int, cache_dir: str) -> Probe:
    """H0's probe; it subtracts the block host time, so that one runs first (`nonmatmul_width`)."""
    key = f"nonmatmul_width|blocks={BLOCKS}|threads={threads}"
    return Probe(key, "blocks", 3.0, lambda: measure_nonmatmul_width(threads, block_overhead_us(cache_dir) * 1e-6))


def nonmatmul_width(threads: int, cache_dir: str) -> float:
    """H0 of this CPU at `threads` threads, measured once, cached."""
    probe = width_probe(threads, cache_dir)
    return float(measure([block_probe(), probe], cache_dir)[probe.key])
