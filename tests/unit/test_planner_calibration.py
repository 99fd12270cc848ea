"""The cpu profile's calibration: measured GEMM peak, gloo all-reduce latency and bandwidth, and the
host time of tensor-parallel dispatch and of one block, cached (a few s)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.config.hardware import HardwareConfig
from launcher.config.schema import CONF_DIR, compose_config
from launcher.hardware import probes
from launcher.hardware import resolve as hardware

CPU_YAML = Path(CONF_DIR) / "hardware" / "cpu.yaml"


@pytest.mark.slow
def test_resolve_hardware_measures_once_and_caches(tmp_path, monkeypatch):
    cpu = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(CPU_YAML)))
    assert cpu.peak_tflops is None and cpu.host_overhead_us is None and cpu.block_overhead_us is None
    assert cpu.links[0].bandwidth_gbs is None and cpu.links[0].latency_us is None
    assert cpu.links[0].all_gather_gbs is None and cpu.links[0].reduce_scatter_gbs is None
    assert cpu.links[0].by_size is None and cpu.host_copy_ns_per_byte is None and cpu.nonmatmul_width is None
    monkeypatch.setattr(probes.gemm, "measure_gemm_flops", lambda threads: 1e10)  # the GEMM has its own test
    resolved = hardware.resolve_hardware(cpu, 1, str(tmp_path))
    assert resolved.peak_tflops == pytest.approx(0.01)
    link = resolved.links[0]
    assert 0.01 < link.bandwidth_gbs < 1000  # GB/s between two local gloo processes
    assert 1 < link.latency_us < 100_000  # a 4-byte all-reduce: tens of microseconds to milliseconds
    assert 0.001 < link.all_gather_gbs < 1000 and 0.001 < link.reduce_scatter_gbs < 1000  # as by_size: under load
    assert 0.01 < link.all_to_all_gbs < 1000
    # by message size: [bytes, all-reduce, all-gather, reduce-scatter, all-to-all GB/s], the largest = the above
    assert [row[0] for row in link.by_size] == [2**18, 2**21, 2**24]
    assert link.by_size[-1][1:] == [
        link.bandwidth_gbs,
        link.all_gather_gbs,
        link.reduce_scatter_gbs,
        link.all_to_all_gbs,
    ]
    assert all(0.001 < gbs < 1000 for row in link.by_size for gbs in row[1:])
    assert 0.01 < resolved.host_copy_ns_per_byte < 100  # memory at 0.01-100 GB/s, page faults included
    assert 10 < resolved.host_overhead_us < 1_000_000  # DTensor dispatch of one block: well above zero
    assert 50 < resolved.block_overhead_us < 100_000  # ~100 ops forward and backward: about a millisecond
    assert 0.1 < resolved.optimizer_ns_per_param < 1000  # fused AdamW streams ~28 bytes per parameter
    assert 0.1 < resolved.matmul_efficiency <= 1.0  # the sustained GEMM rate over the (mocked) peak
    assert 10 < resolved.nonmatmul_width < 2000  # H0: 60-180 on this project's machine (planner/efficiency.py)

    def fail(*args, **kwargs):
        raise AssertionError("measured again")

    for module, name in (
        (probes.gemm, "measure_gemm_flops"),
        (probes.gemm, "measure_gemm_sustained"),
        (probes.link, "measure_gloo_link"),
        (probes.host, "measure_tp_overhead"),
        (probes.host, "measure_block_overhead"),
        (probes.host, "measure_optimizer_step"),
        (probes.host, "measure_host_copy"),
        (probes.block, "measure_nonmatmul_width"),
    ):
        monkeypatch.setattr(module, name, fail)
    again = hardware.resolve_hardware(cpu, 1, str(tmp_path))
    assert again.links[0] == link and again.host_overhead_us == resolved.host_overhead_us
    assert again.block_overhead_us == resolved.block_overhead_us
    assert again.optimizer_ns_per_param == resolved.optimizer_ns_per_param
    assert again.matmul_efficiency == resolved.matmul_efficiency
    assert again.host_copy_ns_per_byte == resolved.host_copy_ns_per_byte
    assert again.nonmatmul_width == resolved.nonmatmul_width


def test_gemm_peak_is_recorded_with_when_and_how_and_raised_only_by_a_clear_margin(tmp_path, monkeypatch):
    monkeypatch.setattr(probes.gemm, "measure_gemm_flops", lambda threads: 100e9)
    assert probes.gemm_flops(2, str(tmp_path)) == 100e9
    entry = next(iter(json.loads((tmp_path / "calibration.json").read_text()).values()))
    assert entry["flops"] == 100e9 and "best of" in entry["how"] and entry["measured_at"].endswith("Z")
    assert probes.offer_gemm_peak(2, str(tmp_path), 109e9) is None  # within 10%: noise, kept
    assert probes.offer_gemm_peak(2, str(tmp_path), 50e9) is None  # lower: a peak is a maximum
    line = probes.offer_gemm_peak(2, str(tmp_path), 130e9)
    assert line is not None and "100 to 130 GFLOP/s" in line
    assert probes.gemm_flops(2, str(tmp_path)) == 130e9
    assert probes.offer_gemm_peak(4, str(tmp_path), 130e9) is None  # nothing cached: nothing to raise


def test_a_cache_of_bare_numbers_still_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(probes.gemm, "measure_gemm_flops", lambda threads: 100e9)
    probes.gemm_flops(1, str(tmp_path))
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({k: 42e9 for k in json.loads(path.read_text())}))  # the old format
    assert probes.gemm_flops(1, str(tmp_path)) == 42e9


def test_measured_gemm_peak_is_the_best_trial(monkeypatch):
    assert probes.measure_gemm_flops(1, n=128, seconds=0.1, trials=2) > 1e8


def test_cache_dir_of_a_config_built_in_python_resolves_its_environment_default(monkeypatch):
    """TrainConfig() holds the `${oc.env:...}` default unresolved: the cache must not land in a folder of
    that literal name under the working directory (one did, in the checkout)."""
    from launcher.config.schema import TrainConfig
    from launcher.hardware.probes.cache import cache_file

    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert cache_file(TrainConfig().cache_dir) == Path("/somewhere/cache/launcher/calibration.json")


LINK = {  # a gloo link's fields as measure_gloo_link returns them
    "latency_us": 50.0,
    **dict(zip(probes.link.NAMES, (2.0, 1.0, 1.0, 1.0), strict=True)),
    "by_size": [[float(n), 2.0, 1.0, 1.0, 1.0] for n in probes.link.GLOO_SIZES],
}
PROBES = {  # each probe's measurement, and what it returns here
    (probes.gemm, "measure_gemm_flops"): 1e10,
    (probes.gemm, "measure_gemm_sustained"): 8e9,
    (probes.link, "measure_gloo_link"): LINK,
    (probes.host, "measure_tp_overhead"): 100.0,
    (probes.host, "measure_block_overhead"): 500.0,
    (probes.host, "measure_optimizer_step"): 3.0,
    (probes.host, "measure_host_copy"): 0.1,
    (probes.block, "measure_nonmatmul_width"): 80.0,
}


def test_a_fresh_cache_is_calibrated_under_one_line_each_probe_once(tmp_path, monkeypatch, capsys):
    """What `train` and `plan` resolve on a fresh cache: one line names what is measured, about how long
    and where it is cached, and each probe runs once (the block host time ran twice: the non-matmul
    width, which reads it inside its own measurement, wrote back a copy of the cache read before it)."""
    from launcher.planner import resolve

    runs: Counter[str] = Counter()

    def probe(name: str, value: object):
        def measure(*args, **kwargs):
            runs[name] += 1
            return value

        return measure

    for (module, name), value in PROBES.items():
        monkeypatch.setattr(module, name, probe(name, value))
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))  # a busy machine's note is its own test
    cfg = compose_config("+model=tiny", "hardware=cpu", f"cache_dir={tmp_path}", "threads=1")
    resolve(cfg)  # one process: no link and no tensor-parallel dispatch to price, so none measured yet
    path = tmp_path / "calibration.json"
    line = f"calibrating this CPU once (gemm, host, blocks; ~18 s), cached in {path} ... done in 0 s"
    assert capsys.readouterr().err.splitlines() == [line]
    alone = {"measure_gloo_link", "measure_tp_overhead"}
    assert runs == Counter({name: 1 for _, name in PROBES if name not in alone})
    resolve(compose_config("+model=tiny", "hardware=cpu", f"cache_dir={tmp_path}", "threads=1", "tp=2"))
    line = f"calibrating this CPU once (host, links; ~16 s), cached in {path} ... done in 0 s"
    assert capsys.readouterr().err.splitlines() == [line]  # what two processes add, then
    assert runs == Counter({name: 1 for _, name in PROBES})
    assert len(json.loads(path.read_text())) == len(PROBES)
    resolve(cfg)  # cached: nothing measured, nothing said
    assert capsys.readouterr().err == "" and runs.total() == len(PROBES)
