"""The keys of a hardware profile (conf/hardware/*.yaml): the device, each level of its interconnect,
and what a run on it costs and loses to failures (`plan.tokens`); `load_profile` reads a packaged one by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from launcher.config.ranges import ranged
from launcher.errors import LauncherError

PROFILE_DIR = Path(__file__).resolve().parents[1] / "conf" / "hardware"


@dataclass
class LinkConfig:
    """One level of the interconnect: devices that share it, bandwidth per device, latency."""

    name: str = "link"
    size: int = ranged(1, ge=1)  # devices inside one domain of this level
    bandwidth_gbs: float | None = ranged(None, gt=0)  # GB/s per device, one direction; None: calibrate (cpu)
    latency_us: float | None = ranged(1.0, ge=0)  # per hop; None: calibrate (cpu)
    # GB/s per device of these two collectives where the backend does not reach the ring algorithm's
    # (gloo's reduce-scatter all-reduces the whole buffer); None: bandwidth_gbs (cpu: calibrated)
    all_gather_gbs: float | None = ranged(None, gt=0)
    reduce_scatter_gbs: float | None = ranged(None, gt=0)
    all_to_all_gbs: float | None = ranged(None, gt=0)
    # bandwidth by message size where it varies (cpu: gloo, calibrated): rows [bytes, all-reduce,
    # all-gather, reduce-scatter, all-to-all GB/s]; between rows the planner interpolates in log size,
    # outside them it takes the nearest row. None: the single numbers above at every size
    by_size: list[list[float]] | None = ranged(None, gt=0)
    # share of these bandwidths collectives reach; None: 0.8 of a datasheet number, all of a calibrated
    # one (a profile fitted to runs, `plan.calibrate`, writes 1: its numbers are what the runs reached)
    efficiency: float | None = ranged(None, gt=0, le=1)


@dataclass
class HardwareConfig:
    name: str = "cpu"
    kind: str = "cpu"  # cpu | cuda | tpu (tpu: planner only)
    peak_tflops: float | None = ranged(None, gt=0)  # dense bf16 (fp32 on cpu); None: calibrate (cpu)
    # dense peaks of the narrower tensor-core dtypes, from the vendor's datasheet; None: the device has no such
    # units (dtype=fp8 is refused there unless fp8.emulate=true). MFU stays against peak_tflops (bf16)
    peak_tflops_fp8: float | None = ranged(None, gt=0)
    peak_tflops_fp4: float | None = ranged(None, gt=0)
    memory_gib: float = ranged(16.0, gt=0)
    devices_per_node: int = ranged(1, ge=1)
    # achievable share of peak for large matmuls (planner); None: calibrate (cpu: sustained over peak GEMM)
    matmul_efficiency: float | None = ranged(1.0, gt=0, le=1)
    # achievable share of peak_tflops_fp8 for large fp8 matmuls (planner, dtype=fp8; docs/planner.md): lower
    # than bf16's share (scaled GEMMs, younger kernels); None: matmul_efficiency
    fp8_matmul_efficiency: float | None = ranged(None, gt=0, le=1)
    # device memory bandwidth (HBM), GB/s: what the work that is not matmul is bound by (planner);
    # None: the planner's per-kind constant instead (cpu)
    memory_bandwidth_gbs: float | None = ranged(None, gt=0)
    # H0: the model width at which a block's work that is not matmul takes as long as its matmuls (planner/
    # efficiency.py); 0: NONMATMUL x the device's FLOP per byte (accelerators). None: calibrate (cpu)
    nonmatmul_width: float | None = ranged(0.0, ge=0)
    # host time per tensor-parallel block and microbatch that no device work hides: DTensor dispatch
    # on a CPU, where the host is the device; 0 on accelerators (launches run ahead). None: calibrate
    host_overhead_us: float | None = ranged(0.0, ge=0)
    # host time per block and microbatch, forward + backward, that no device work hides: the framework's
    # dispatch of the block's ops on a CPU; 0 on accelerators (launches run ahead). None: calibrate
    block_overhead_us: float | None = ranged(0.0, ge=0)
    # host time of the optimizer step per parameter a device updates (cpu: fused AdamW streaming from
    # memory); 0 on accelerators, where it is well under 1% of a step. None: calibrate
    optimizer_ns_per_param: float | None = ranged(0.0, ge=0)
    # host time per byte of the copies FSDP makes around its collectives (cpu: into freshly allocated
    # buffers, page faults included); 0 on accelerators (device copies at HBM speed). None: calibrate
    host_copy_ns_per_byte: float | None = ranged(0.0, ge=0)
    links: list[LinkConfig] = field(default_factory=list)
    # `plan.tokens` (launcher/planner/budget.py). USD per device-hour: each profile's YAML gives an
    # approximate on-demand list price (they vary 2-3x by provider and commitment); None: no cost shown
    price_per_hour: float | None = ranged(None, gt=0)
    # mean hours between job-stopping failures per device: Llama 3 405B (Dubey et al. 2024, section
    # 3.3.4) saw 419 unexpected interruptions in 54 days on 16,384 H100s, 16,384 x 54 x 24 / 419 =
    # 50,677 GPU-hours each; no other accelerator has a published figure, so every profile takes it
    device_mtbf_hours: float = ranged(50_700.0, gt=0)
    # checkpoint write bandwidth per device, GB/s (the storage's aggregate over the devices writing):
    # Llama 3's Tectonic sustains 2 TB/s for 16,384 GPUs (same section), 0.12 GB/s each
    storage_gbs: float = ranged(0.12, gt=0)
    # seconds from a failure to training again: detect, reschedule, start processes, join NCCL, load the
    # checkpoint. Not a published figure: 10 minutes, measure yours (a resumed run's time to its first step)
    restart_s: float = ranged(600.0, ge=0)


# HardwareConfig's scalar numbers that None asks to calibrate on this machine (cpu: launcher/hardware/resolve.py)
CALIBRATED = (
    "peak_tflops",
    "matmul_efficiency",
    "nonmatmul_width",
    "host_overhead_us",
    "block_overhead_us",
    "optimizer_ns_per_param",
    "host_copy_ns_per_byte",
)


def profile_names() -> list[str]:
    return sorted(path.stem for path in PROFILE_DIR.glob("*.yaml"))


def load_profile(name: str, key: str = "hardware") -> HardwareConfig:
    """The packaged profile `name` (launcher/conf/hardware/NAME.yaml) over the schema's defaults;
    `key` names the config key that asked for it in the error line."""
    from omegaconf import OmegaConf

    if name not in profile_names():
        raise LauncherError(f"{key}: no hardware profile '{name}': choose from {', '.join(profile_names())}")
    node = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(PROFILE_DIR / f"{name}.yaml"))
    return OmegaConf.to_object(node)  # type: ignore[return-value]
