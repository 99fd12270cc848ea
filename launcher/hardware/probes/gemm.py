"""The CPU's GEMM rates: the practical fp32 peak at a worker's thread count, and the rate sustained with
every core busy, over that peak (the cpu profile's matmul efficiency).

The peak is the best of several trials after a warm-up (a peak is a maximum: a trial at a busy moment
must not lower it), cached with when and how it was measured; a later measurement (`make bench`) that
beats it by more than PEAK_MARGIN replaces it, with one line saying so. The sustained rate is the median
trial with one process of `threads` threads per `threads` cores, as the workers run (the best of
GEMM_ROUNDS rounds). A lone core's best trial runs faster (turbo, a quiet moment) than training
sustains: 220 vs 185 GFLOP/s on this machine.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from launcher.files import write_json
from launcher.hardware.probes.cache import Probe, cache_file, cached_measure, full_key, measure, read_cache
from launcher.hardware.probes.harness import run_ranks, torch_threads

GEMM_N, GEMM_TRIALS, GEMM_WARMUP_S, GEMM_ROUNDS = 1024, 5, 0.2, 3
PEAK_MARGIN = 0.10  # a later GEMM measurement this much above the cached peak replaces it


def gemm_rates(n: int, seconds: float, rounds: int, pause: float) -> Iterator[list[float]]:
    """After GEMM_WARMUP_S of warm-up (caches, frequency), `rounds` rounds of `seconds / rounds` each,
    a pause after each (another process's burst passes): per round, the FLOP/s of each 4-matmul batch."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    end = time.perf_counter() + GEMM_WARMUP_S
    while time.perf_counter() < end:
        torch.mm(a, b)
    for _ in range(rounds):
        rates, end = [], time.perf_counter() + seconds / rounds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            rates.append(4 * 2 * n**3 / (time.perf_counter() - t0))
        yield rates
        time.sleep(pause)


def measure_gemm_flops(threads: int, n: int = GEMM_N, seconds: float = 1.0, trials: int = GEMM_TRIALS) -> float:
    """Best fp32 GEMM FLOP/s with `threads` intra-op threads (the CPU's practical peak): the best
    4-matmul time of `trials` trials (`gemm_rates`)."""
    with torch_threads(threads):
        return max(max(rates) for rates in gemm_rates(n, seconds, trials, pause=0.05))


def _gemm_worker(rank: int, world: int, port: int, seconds: float) -> str:
    """One of `world` processes running GEMMs at once: its median trial, FLOP/s, in the best of
    GEMM_ROUNDS rounds (as for the peak, a round at a moment another job is busy must not lower it;
    rank and port unused)."""
    import torch

    torch.set_num_threads(int(os.environ.get("LAUNCHER_GEMM_THREADS", "1")))
    return str(max(statistics.median(rates) for rates in gemm_rates(GEMM_N, seconds, GEMM_ROUNDS, pause=0.2)))


def measure_gemm_sustained(threads: int, seconds: float = 2.4) -> float:
    """Median fp32 GEMM FLOP/s of one of the processes filling the cores (`threads` threads each)."""
    procs = max(1, (os.cpu_count() or 1) // threads)
    return float(run_ranks(_gemm_worker, procs, seconds, {"LAUNCHER_GEMM_THREADS": str(threads)}))


def sustained_probe(threads: int) -> Probe:
    return Probe(f"gemm_fp32_sustained|threads={threads}", "gemm", 6.0, lambda: measure_gemm_sustained(threads))


def gemm_efficiency(threads: int, cache_dir: str) -> float:
    """The sustained GEMM rate with every core busy over the peak (at most 1), measured once, cached."""
    peak, sustained = peak_probe(threads), sustained_probe(threads)
    values = measure([peak, sustained], cache_dir)  # both under one line
    return min(1.0, float(values[sustained.key]) / _flops(values[peak.key]))


def _gemm_key(threads: int) -> str:
    return f"gemm_fp32|threads={threads}"


def peak_probe(threads: int) -> Probe:
    return Probe(_gemm_key(threads), "gemm", 2.0, lambda: gemm_record(threads))


def gemm_record(threads: int, flops: float | None = None) -> dict[str, Any]:
    """A cache entry for the GEMM peak: the value, when and how it was measured."""
    how = f"best of {GEMM_TRIALS} trials, {GEMM_N}^3 fp32 matmuls, {threads} threads, after {GEMM_WARMUP_S} s warm-up"
    value = measure_gemm_flops(threads) if flops is None else flops
    return {"flops": value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "how": how}


def _flops(entry: Any) -> float:
    return float(entry["flops"] if isinstance(entry, dict) else entry)  # older caches: a bare number


def gemm_flops(threads: int, cache_dir: str) -> float:
    """The CPU's practical fp32 peak at `threads` threads, measured once, cached."""
    return _flops(cached_measure(cache_dir, peak_probe(threads)))


def cached_gemm_flops(threads: int, cache_dir: str) -> float | None:
    """The cached GEMM peak at `threads` threads, or None when this machine was never calibrated (no measuring)."""
    entry = read_cache(cache_file(cache_dir)).get(full_key(_gemm_key(threads)))
    return None if entry is None else _flops(entry)


def offer_gemm_peak(threads: int, cache_dir: str, measured: float) -> str | None:
    """A later GEMM measurement: when it beats the cached peak by more than PEAK_MARGIN, it replaces it
    (the cached one was taken at a busy moment, and inflated every MFU since); the one line saying so."""
    path = cache_file(cache_dir)
    cache = read_cache(path)
    key = full_key(_gemm_key(threads))
    if key not in cache or measured <= _flops(cache[key]) * (1 + PEAK_MARGIN):
        return None
    old = _flops(cache[key])
    cache[key] = gemm_record(threads, measured)
    write_json(path, cache)
    return f"GEMM peak at {threads} threads raised from {old / 1e9:.0f} to {measured / 1e9:.0f} GFLOP/s (in {path})"
