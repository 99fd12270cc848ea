"""`python -m bench [NAME ...]`: run the named benchmarks (default: all CPU ones) and print their tables."""

from __future__ import annotations

import importlib
import sys

BENCHES = [
    "overhead",
    "parallel",
    "checkpoint",
    "planner_accuracy",
    "published_runs",
    "planner_speed",
    "memory",
    "tokenize",
    "schedules",
    "split_backward",
    "recompute",
    "context",
    "hf_import",
    "peer_shape",
    "peer_floor",
    "moe",
    "fsdp_cpu",
    "fsdp_accumulation",
    "spike",
    "data",
    "ft",
]
# by name only: a CUDA device (`make gpu-check`); tens of minutes (simulate_real: real runs of 1b on this CPU too)
ON_DEMAND = ["gpu_check", "simulate_grid", "simulate_real"]


def main(argv: list[str]) -> None:
    names = [a for a in argv if not a.startswith("-")] or BENCHES
    for name in names:
        if name not in BENCHES + ON_DEMAND:
            raise SystemExit(f"unknown benchmark '{name}': choose from {', '.join(BENCHES + ON_DEMAND)}")
        importlib.import_module(f"bench.{name}").main([a for a in argv if a.startswith("-")])


if __name__ == "__main__":
    main(sys.argv[1:])
