"""CPU calibration: the numbers the `cpu` profile leaves null, measured on this machine.

- gemm: the GEMM peak at a worker's thread count, and the rate sustained with every core busy over it
  (the cpu profile's matmul efficiency);
- block: the width at which a block's work that is not matmul takes as long as its matmuls (H0);
- link: the gloo link between 2 local processes (latency, and each collective's bandwidth by size);
- host: the host time a CPU pays beside its FLOPs (DTensor's dispatch per tensor-parallel block, each
  block's framework dispatch, the optimizer step per parameter, FSDP's copies per byte).

Each is measured once per machine (CPU model, torch version, threads) and cached (cache: one JSON file
in `cache_dir`), so later runs start instantly; whatever a profile needs and the cache lacks is measured
in one go under one line (`measure`, `probes_for`); the multi-process probes run in fresh interpreters
(harness). torch is imported only to measure.
"""

from __future__ import annotations

from collections.abc import Iterable

from launcher.hardware.probes import gemm, host
from launcher.hardware.probes.block import nonmatmul_width, width_probe
from launcher.hardware.probes.cache import Probe, measure
from launcher.hardware.probes.gemm import (
    cached_gemm_flops,
    gemm_efficiency,
    gemm_flops,
    measure_gemm_flops,
    offer_gemm_peak,
)
from launcher.hardware.probes.host import (
    block_overhead_us,
    host_copy_ns_per_byte,
    optimizer_ns_per_param,
    tp_overhead_us,
)
from launcher.hardware.probes.link import gloo_link, link_probe

__all__ = [
    "block_overhead_us",
    "cached_gemm_flops",
    "measure",
    "gemm_efficiency",
    "gemm_flops",
    "gloo_link",
    "host_copy_ns_per_byte",
    "measure_gemm_flops",
    "nonmatmul_width",
    "offer_gemm_peak",
    "optimizer_ns_per_param",
    "probes",
    "tp_overhead_us",
]


def probes_for(names: Iterable[str], threads: int, cache_dir: str) -> list[Probe]:
    """The probes behind a profile's null numbers `names` (launcher/config/hardware.py's CALIBRATED, and
    "links"), each once, in the order they run: the block host time before the width that subtracts it."""
    behind = {
        "peak_tflops": [gemm.peak_probe(threads)],
        "matmul_efficiency": [gemm.peak_probe(threads), gemm.sustained_probe(threads)],
        "links": [link_probe()],
        "nonmatmul_width": [host.block_probe(), width_probe(threads, cache_dir)],
        "host_overhead_us": [host.tp_probe()],
        "block_overhead_us": [host.block_probe()],
        "optimizer_ns_per_param": [host.optimizer_probe()],
        "host_copy_ns_per_byte": [host.copy_probe()],
    }
    return list({p.key: p for name in names for p in behind[name]}.values())
