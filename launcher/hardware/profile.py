"""A hardware profile as numbers the planner computes with (FLOP/s, bytes, bytes/s, seconds).

Datasheet link bandwidths are scaled by LINK_EFFICIENCY (what collectives reach in practice);
measured ones (the cpu profile's gloo calibration) are used as they are; a link's own
`efficiency` (a profile fitted to runs: 1) replaces either. Null numbers (cpu) are
calibrated by `launcher.hardware.resolve.resolve_hardware` (launcher/hardware/probes/), the only path on which
torch is imported.
"""

from __future__ import annotations

from launcher.config.hardware import CALIBRATED, HardwareConfig, LinkConfig
from launcher.config.ranges import check_ranges
from launcher.errors import LauncherError
from launcher.flops import GIB, device_flop_per_byte
from launcher.hardware.machine import Level, Machine

LINK_EFFICIENCY = 0.8  # nccl-tests bus bandwidth is typically 75-90% of the datasheet link rate
KINDS = ("cpu", "cuda", "tpu")


def needs_calibration(hw: HardwareConfig) -> bool:
    links = any(link.bandwidth_gbs is None or link.latency_us is None for link in hw.links)
    return links or any(getattr(hw, name) is None for name in CALIBRATED)


def validate(hw: HardwareConfig) -> None:
    if hw.kind not in KINDS:
        raise LauncherError(f"hardware.kind={hw.kind!r} is unknown: use one of {', '.join(KINDS)}")
    if not hw.links:
        raise LauncherError(f"hardware '{hw.name}' has no links: give at least one level in hardware.links")
    check_ranges(hw, "hardware.")
    if needs_calibration(hw) and hw.kind != "cpu":
        raise LauncherError(
            f"hardware '{hw.name}' has a null {', '.join(CALIBRATED)} or link bandwidth_gbs/latency_us: "
            "only the cpu profile is calibrated; give the datasheet numbers"
        )


def resolved_hardware(hw: HardwareConfig, threads: int, cache_dir: str, alone: bool = False) -> HardwareConfig:
    """`hw` with the numbers a CPU profile leaves null measured (cached) at `threads` per worker
    (`alone`: those a one-process layout uses)."""
    if not needs_calibration(hw):
        return hw
    from launcher.hardware.resolve import resolve_hardware  # imports torch: cpu calibration only

    return resolve_hardware(hw, threads, cache_dir, alone)


def machine(hw: HardwareConfig, threads: int, cache_dir: str, alone: bool = False) -> Machine:
    """Resolve `hw` (calibrating null numbers on this CPU) into a Machine. `alone`: for a one-process
    layout, whose links and tensor-parallel dispatch stay unmeasured (priced at nothing: never used)."""
    validate(hw)
    flop_per_byte = device_flop_per_byte(hw.kind, hw.peak_tflops, hw.memory_bandwidth_gbs)  # as the runtime reads it
    measured = {link.name for link in hw.links if link.bandwidth_gbs is None}
    hw = resolved_hardware(hw, threads, cache_dir, alone)

    def rate(link: LinkConfig, gbs: float | None) -> float | None:
        share = link.efficiency or (1.0 if link.name in measured else LINK_EFFICIENCY)
        return None if gbs is None else float(gbs) * 1e9 * share

    levels = tuple(
        Level(
            name=link.name,
            size=link.size,
            bandwidth=rate(link, link.bandwidth_gbs),
            latency=(link.latency_us or 0.0) * 1e-6,  # null only `alone`
            gather_bandwidth=rate(link, link.all_gather_gbs),
            scatter_bandwidth=rate(link, link.reduce_scatter_gbs),
            all_to_all_bandwidth=rate(link, link.all_to_all_gbs),
            by_size=tuple((row[0], *(rate(link, r) for r in row[1:])) for row in link.by_size or ()),
        )
        for link in sorted(hw.links, key=lambda link: link.size)
    )
    return Machine(
        name=hw.name,
        kind=hw.kind,
        peak_flops=float(hw.peak_tflops) * 1e12,
        memory_bytes=hw.memory_gib * GIB,
        matmul_efficiency=hw.matmul_efficiency,
        devices_per_node=hw.devices_per_node,
        levels=levels,
        host_overhead=float(hw.host_overhead_us or 0.0) * 1e-6,
        block_overhead=float(hw.block_overhead_us) * 1e-6,
        optimizer_time=float(hw.optimizer_ns_per_param) * 1e-9,
        host_copy_time=float(hw.host_copy_ns_per_byte) * 1e-9,
        memory_bandwidth=None if hw.memory_bandwidth_gbs is None else hw.memory_bandwidth_gbs * 1e9,
        flop_per_byte=flop_per_byte,
        nonmatmul_width=hw.nonmatmul_width or 0.0,
    )
