"""The cpu profile's calibration: measured GEMM peak, gloo all-reduce latency and bandwidth, and the
host time of tensor-parallel dispatch, cached (a few s)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher import calibration, hardware
from launcher.config import HardwareConfig

CPU_YAML = Path(__file__).resolve().parents[1] / "conf" / "hardware" / "cpu.yaml"


def test_resolve_hardware_measures_once_and_caches(tmp_path, monkeypatch):
    cpu = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(CPU_YAML)))
    assert cpu.peak_tflops is None and cpu.host_overhead_us is None
    assert cpu.links[0].bandwidth_gbs is None and cpu.links[0].latency_us is None
    assert cpu.links[0].all_gather_gbs is None and cpu.links[0].reduce_scatter_gbs is None
    monkeypatch.setattr(calibration, "measure_gemm_flops", lambda threads: 1e10)  # the GEMM has its own test
    resolved = hardware.resolve_hardware(cpu, 1, str(tmp_path))
    assert resolved.peak_tflops == pytest.approx(0.01)
    link = resolved.links[0]
    assert 0.01 < link.bandwidth_gbs < 1000  # GB/s between two local gloo processes
    assert 1 < link.latency_us < 100_000  # a 4-byte all-reduce: tens of microseconds to milliseconds
    assert 0.01 < link.all_gather_gbs < 1000 and 0.01 < link.reduce_scatter_gbs < 1000
    assert 10 < resolved.host_overhead_us < 1_000_000  # DTensor dispatch of one block: well above zero

    def fail(*args, **kwargs):
        raise AssertionError("measured again")

    for name in ("measure_gemm_flops", "measure_gloo_link", "measure_tp_overhead"):
        monkeypatch.setattr(calibration, name, fail)
    again = hardware.resolve_hardware(cpu, 1, str(tmp_path))
    assert again.links[0] == link and again.host_overhead_us == resolved.host_overhead_us
