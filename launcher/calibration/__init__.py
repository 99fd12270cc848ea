"""CPU calibration: the numbers the `cpu` profile leaves null, measured on this machine.

- gemm: the GEMM peak at a worker's thread count, and the rate sustained with every core busy over it
  (the cpu profile's matmul efficiency);
- block: the width at which a block's work that is not matmul takes as long as its matmuls (H0);
- link: the gloo link between 2 local processes (latency, and each collective's bandwidth by size);
- host: the host time a CPU pays beside its FLOPs (DTensor's dispatch per tensor-parallel block, each
  block's framework dispatch, the optimizer step per parameter, FSDP's copies per byte).

Each is measured once per machine (CPU model, torch version, threads) and cached (cache: one JSON file
in `cache_dir`), so later runs start instantly; the multi-process probes run in fresh interpreters
(harness). torch is imported only to measure.
"""

from __future__ import annotations

from launcher.calibration.block import nonmatmul_width
from launcher.calibration.gemm import (
    cached_gemm_flops,
    gemm_efficiency,
    gemm_flops,
    measure_gemm_flops,
    offer_gemm_peak,
)
from launcher.calibration.host import block_overhead_us, host_copy_ns_per_byte, optimizer_ns_per_param, tp_overhead_us
from launcher.calibration.link import gloo_link

__all__ = [
    "block_overhead_us",
    "cached_gemm_flops",
    "gemm_efficiency",
    "gemm_flops",
    "gloo_link",
    "host_copy_ns_per_byte",
    "measure_gemm_flops",
    "nonmatmul_width",
    "offer_gemm_peak",
    "optimizer_ns_per_param",
    "tp_overhead_us",
]
