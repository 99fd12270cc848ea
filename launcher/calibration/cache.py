"""The calibration cache: `<cache_dir>/calibration.json`, each number keyed by the CPU model, the torch
version and what was measured (threads included), so a machine is measured once and later runs start
instantly. A corrupt cache is measured again, never fatal."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.files import make_dir, write_json


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


def cached_measure(cache_dir: str, key: str, measure: Callable[[], Any]) -> Any:
    """Return the cached value for `key` on this machine, measuring (and caching) it once."""
    entry = full_key(key)
    path = cache_file(cache_dir)
    cache = read_cache(path)
    if entry not in cache:
        make_dir(path.parent, "cache_dir")  # before measuring: a cache that cannot be written is bad input
        print(f"calibrating this machine, once: {key} (cached in {path})", file=sys.stderr, flush=True)
        cache[entry] = measure()
        write_json(path, cache)
    return cache[entry]
