"""Hardware profiles: peak FLOP/s, memory and link levels (conf/hardware/*.yaml), and CPU calibration.

GPU numbers come from the YAML files (datasheets). The `cpu` profile leaves its peak (and link
bandwidth) null: they are measured once on this machine, for the thread count a worker uses, and
cached in a small JSON file so later runs start instantly. torch is imported only to measure.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.config import HardwareConfig, LauncherError


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file(cache_dir: str) -> Path:
    return Path(cache_dir).expanduser() / "calibration.json"


def cached_measure(cache_dir: str, key: str, measure: Callable[[], float]) -> float:
    """Return the cached value for `key` on this machine, measuring (and caching) it once."""
    import torch

    full_key = f"{cpu_model()}|torch={torch.__version__}|{key}"
    path = _cache_file(cache_dir)
    cache: dict[str, Any] = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}  # a corrupt cache is re-measured, never fatal
    if full_key not in cache:
        cache[full_key] = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    return float(cache[full_key])


def measure_gemm_flops(threads: int, n: int = 1024, seconds: float = 0.6) -> float:
    """Best fp32 GEMM FLOP/s with `threads` intra-op threads (the CPU's practical peak)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm up
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(old)


def peak_flops(hw: HardwareConfig, threads: int, cache_dir: str) -> float:
    """Peak FLOP/s of one device: the profile's number, or the calibrated CPU GEMM peak."""
    if hw.peak_tflops is not None:
        return hw.peak_tflops * 1e12
    if hw.kind != "cpu":
        raise LauncherError(f"hardware.peak_tflops is not set for '{hw.name}': give its bf16 dense peak")
    return cached_measure(cache_dir, f"gemm_fp32|threads={threads}", lambda: measure_gemm_flops(threads))
