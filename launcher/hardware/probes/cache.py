"""The calibration cache: `<cache_dir>/calibration.json`, each number keyed by the CPU model, the torch
version and what was measured (threads included), so a machine is measured once and later runs start
instantly. A corrupt cache is measured again, never fatal. Whatever the cache lacks is measured in one
go (`measure`), announced in one line."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.files import make_dir, write_json


@dataclass(frozen=True)
class Probe:
    """One number measured on this machine: its cache key, its group in the announcing line, about how
    many seconds it takes here, and how to measure it."""

    key: str
    what: str  # gemm | links | blocks | host
    seconds: float
    measure: Callable[[], Any]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_file(cache_dir: str) -> Path:
    """A TrainConfig built in Python, not composed by Hydra, still holds its default's `${oc.env:...}`:
    resolved here, else the cache would land in a folder of that literal name under the working directory."""
    if "${" in cache_dir:
        from omegaconf import OmegaConf

        cache_dir = OmegaConf.create({"dir": cache_dir}).dir
    return Path(cache_dir).expanduser() / "calibration.json"


def read_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}  # a corrupt cache is re-measured, never fatal


def full_key(key: str) -> str:
    """A cache entry holds for one CPU model and torch version."""
    import torch

    return f"{cpu_model()}|torch={torch.__version__}|{key}"


def store(path: Path, key: str, value: Any) -> Any:
    """`value` into the cache as it is now: a probe that ran inside another's measurement (the block host
    time inside the non-matmul width's) wrote its entry meanwhile, which a copy read before would drop."""
    cache = read_cache(path)
    cache[full_key(key)] = value
    write_json(path, cache)
    return value


def home_shown(path: Path) -> str:
    return f"~/{path.relative_to(Path.home())}" if path.is_relative_to(Path.home()) else str(path)


def measure(probes: list[Probe], cache_dir: str) -> dict[str, Any]:
    """Every probe's value on this machine, by key: the cache's, and those it lacks measured now, in
    order, under one line (`calibrating this CPU once (gemm, host; ~9 s), cached in PATH ... done in 8 s`)."""
    path = cache_file(cache_dir)
    cache = read_cache(path)
    values = {p.key: cache[full_key(p.key)] for p in probes if full_key(p.key) in cache}
    missing = [p for p in probes if p.key not in values]
    if not missing:
        return values
    make_dir(path.parent, "cache_dir")  # before measuring: a cache that cannot be written is bad input
    groups = ", ".join(dict.fromkeys(p.what for p in missing))
    about = sum(p.seconds for p in missing)
    print(
        f"calibrating this CPU once ({groups}; ~{about:.0f} s), cached in {home_shown(path)} ...",
        end="",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        for p in missing:
            values[p.key] = store(path, p.key, p.measure())
    except BaseException:
        print(file=sys.stderr, flush=True)  # the line ends before the error's
        raise
    print(f" done in {time.perf_counter() - t0:.0f} s{busy_note()}", file=sys.stderr, flush=True)
    return values


def busy_note() -> str:
    """Said after measuring on a busy machine, whose numbers read low (and every MFU since high)."""
    cores, load = os.cpu_count() or 1, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load <= 0.75 * cores:
        return ""
    return f" (the machine was busy, load {load:.1f} on {cores} cores: `doctor` later re-measures the peak)"


def cached_measure(cache_dir: str, probe: Probe) -> Any:
    """The cached value of `probe` on this machine, measured (and cached) once."""
    return measure([probe], cache_dir)[probe.key]
