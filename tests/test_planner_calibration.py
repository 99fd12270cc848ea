"""The cpu profile's calibration: measured GEMM peak and gloo all-reduce bandwidth, cached (a few s)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher import hardware
from launcher.config import HardwareConfig

CPU_YAML = Path(__file__).resolve().parents[1] / "conf" / "hardware" / "cpu.yaml"


def test_resolve_hardware_measures_once_and_caches(tmp_path, monkeypatch):
    cpu = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(CPU_YAML)))
    monkeypatch.setattr(hardware, "measure_gemm_flops", lambda threads: 1e10)  # the GEMM has its own test
    resolved = hardware.resolve_hardware(cpu, 1, str(tmp_path))
    assert resolved.peak_tflops == pytest.approx(0.01) and cpu.peak_tflops is None
    bw = resolved.links[0].bandwidth_gbs
    assert 0.01 < bw < 1000  # GB/s between two local gloo processes

    def fail(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(hardware, "measure_gloo_bandwidth", fail)
    assert hardware.resolve_hardware(cpu, 1, str(tmp_path)).links[0].bandwidth_gbs == bw
