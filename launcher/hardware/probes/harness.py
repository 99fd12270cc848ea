"""How a probe runs: torch's threads set for its duration, the median of timed calls, and ranks in
fresh interpreters (not multiprocessing: this works from any entry point, inside a process group or
not). torch is imported only to measure."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from launcher.errors import LauncherError

Worker = Callable[[int, int, int, float], str]  # (rank, world, port, seconds) -> its result, one line
TIMEOUT_S = 120


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the duration."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def median_seconds(step: Callable[[], None], seconds: float, warmup: int) -> float:
    """Median seconds of `step` over `seconds` of calls, after `warmup` calls."""
    for _ in range(warmup):
        step()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def same_iteration_exit(end: float) -> bool:
    """True on every rank once any rank is past `end`, so all leave a timing loop together."""
    import torch
    import torch.distributed as dist

    done = torch.tensor([1.0 if time.perf_counter() > end else 0.0])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return done.item() > 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Worker, world: int, seconds: float, extra_env: dict[str, str] | None = None) -> str:
    """Run the module-level `worker(rank, world, port, seconds)` in `world` fresh interpreters; rank 0's
    result. A failure or a timeout is a LauncherError naming the probe."""
    import subprocess

    name, port = worker.__name__, free_port()
    code = f"import sys; from {worker.__module__} import {name} as w; print(w(*map(int, sys.argv[1:4]), {seconds!r}))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[3]), *sys.path]))
    env.update(extra_env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), str(world), str(port)],
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
            out, err = p.communicate(timeout=TIMEOUT_S)
            if p.returncode:
                raise LauncherError(f"cpu calibration ({name}) failed: {err.strip().splitlines()[-1:]}")
            outs.append(out)
    except subprocess.TimeoutExpired as e:
        raise LauncherError(f"cpu calibration ({name}) timed out: give the cpu profile's numbers") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs[0].strip().splitlines()[-1]
