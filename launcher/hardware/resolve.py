"""Hardware profiles: peak FLOP/s, memory and link levels (launcher/conf/hardware/*.yaml), resolved into numbers.

GPU numbers come from the YAML files (datasheets). The `cpu` profile leaves its peak, link and host
overhead null: `resolve_hardware` fills them in from this machine's calibration (launcher/hardware/probes/).
"""

from __future__ import annotations

from dataclasses import replace

from launcher.config.hardware import CALIBRATED, HardwareConfig
from launcher.errors import LauncherError
from launcher.hardware import probes

# a CUDA device's name (torch.cuda.get_device_name) → its hardware profile; anything else: h100_sxm
DEVICE_PROFILES = (("H200", "h200"), ("H100", "h100_sxm"), ("A100", "a100"), ("B200", "b200"), ("V100", "v100_dgx2"))


def profile_for_device(device_name: str) -> str:
    return next((profile for key, profile in DEVICE_PROFILES if key in device_name.upper()), "h100_sxm")


def peak_flops(hw: HardwareConfig, threads: int, cache_dir: str) -> float:
    """Peak FLOP/s of one device: the profile's number, or the calibrated CPU GEMM peak."""
    if hw.peak_tflops is not None:
        return hw.peak_tflops * 1e12
    if hw.kind != "cpu":
        raise LauncherError(f"hardware.peak_tflops is not set for '{hw.name}': give its bf16 dense peak")
    return probes.gemm_flops(threads, cache_dir)


ALONE_UNUSED = ("host_overhead_us", "links")  # what one process never pays: tensor-parallel dispatch, collectives


def resolve_hardware(hw: HardwareConfig, threads: int, cache_dir: str, alone: bool = False) -> HardwareConfig:
    """A copy of `hw` with its null numbers calibrated on this machine (peak FLOP/s at `threads`
    threads, its sustained share, the blocks' non-matmul width, link latency and bandwidth by message
    size, tensor-parallel and per-block host overhead, the optimizer's and the host copies' time).
    `alone` (a one-process layout): the links and the tensor-parallel dispatch stay null, measured
    (16 s of the first run's 35) when a layout of several processes needs them."""
    null = [name for name in CALIBRATED if getattr(hw, name) is None]
    null += ["links"] * any(link.bandwidth_gbs is None or link.latency_us is None for link in hw.links)
    null = [name for name in null if not (alone and name in ALONE_UNUSED)]
    probes.measure(probes.probes_for(null, threads, cache_dir), cache_dir)  # what the cache lacks: one line
    peak = hw.peak_tflops if hw.peak_tflops is not None else peak_flops(hw, threads, cache_dir) / 1e12
    links = []
    for link in hw.links:
        if (link.bandwidth_gbs is None or link.latency_us is None) and "links" in null:
            measured = probes.gloo_link(cache_dir)
            link = replace(link, **{k: v for k, v in measured.items() if getattr(link, k) is None})
        links.append(link)
    measures = {  # CALIBRATED's other numbers (launcher/config/hardware.py)
        "matmul_efficiency": lambda: probes.gemm_efficiency(threads, cache_dir),
        "nonmatmul_width": lambda: probes.nonmatmul_width(threads, cache_dir),
        "host_overhead_us": lambda: probes.tp_overhead_us(cache_dir),
        "block_overhead_us": lambda: probes.block_overhead_us(cache_dir),
        "optimizer_ns_per_param": lambda: probes.optimizer_ns_per_param(cache_dir),
        "host_copy_ns_per_byte": lambda: probes.host_copy_ns_per_byte(cache_dir),
    }
    measured = {name: measure() for name, measure in measures.items() if getattr(hw, name) is None and name in null}
    return replace(hw, peak_tflops=peak, links=links, **measured)
