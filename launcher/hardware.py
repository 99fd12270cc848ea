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


def _gloo_allreduce_worker(rank: int, world: int, port: int, nbytes: int, seconds: float) -> float:
    """One rank of the bandwidth measurement: the best all-reduce time of `nbytes`, in seconds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)  # warm up (connections, buffers)
        best, end = float("inf"), time.perf_counter() + seconds
        while True:
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            best = min(best, time.perf_counter() - t0)
            done = torch.tensor([1.0 if time.perf_counter() > end else 0.0])
            dist.all_reduce(done)  # every rank leaves the loop on the same iteration
            if done.item() > 0:
                return best
    finally:
        dist.destroy_process_group()


def measure_gloo_bandwidth(nbytes: int = 16 * 2**20, seconds: float = 0.5, world: int = 2) -> float:
    """gloo all-reduce bus bandwidth between `world` local processes, GB/s per process, one direction.

    Bus bandwidth = 2 (n - 1)/n x bytes / time, the per-device link rate a ring all-reduce sees: the
    number the planner's collective model divides by. The ranks are fresh interpreters (not
    multiprocessing), so this works from any entry point.
    """
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys; from launcher.hardware import _gloo_allreduce_worker as w; "
        "print(w(*map(int, sys.argv[1:5]), float(sys.argv[5])))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), str(world), str(port), str(nbytes), str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            if p.returncode:
                raise LauncherError(f"gloo bandwidth calibration failed: {err.strip().splitlines()[-1:]}")
            outs.append(out)
    except subprocess.TimeoutExpired as e:
        raise LauncherError("gloo bandwidth calibration timed out: set the cpu link's bandwidth_gbs") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    best = float(outs[0].split()[-1])
    return 2 * (world - 1) / world * nbytes / best / 1e9


def link_bandwidth_gbs(cache_dir: str) -> float:
    """The cpu profile's link bandwidth: measured once with gloo between 2 processes, cached."""
    return cached_measure(cache_dir, "gloo_allreduce_busbw|world=2", measure_gloo_bandwidth)


def resolve_hardware(hw: HardwareConfig, threads: int, cache_dir: str) -> HardwareConfig:
    """A copy of `hw` with its null numbers calibrated on this machine (peak FLOP/s, link bandwidth)."""
    from dataclasses import replace

    peak = hw.peak_tflops if hw.peak_tflops is not None else peak_flops(hw, threads, cache_dir) / 1e12
    links = [
        link if link.bandwidth_gbs is not None else replace(link, bandwidth_gbs=link_bandwidth_gbs(cache_dir))
        for link in hw.links
    ]
    return replace(hw, peak_tflops=peak, links=links)
