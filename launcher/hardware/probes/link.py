"""The gloo link between 2 local processes of 1 thread each: latency, and all-reduce / all-gather /
reduce-scatter / all-to-all bandwidth at three message sizes (gloo at a few MiB reaches about half its
16-MiB bandwidth), as the planner's collective model reads them (launcher/planner/comm.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from launcher.compat.torch_compat import leave_process_groups
from launcher.hardware.probes.cache import Probe, cached_measure
from launcher.hardware.probes.harness import run_ranks, same_iteration_exit

GLOO_SIZES = (2**18, 2**21, 2**24)  # 256 KiB to 16 MiB: what FSDP units, K/V and all-to-alls move
SHARES = (1.0, 0.5, 0.5, 0.5)  # of the buffer each rank moves over 2 ranks: all-reduce, all-gather, ...
NAMES = ("bandwidth_gbs", "all_gather_gbs", "reduce_scatter_gbs", "all_to_all_gbs")


def _collectives(world: int) -> list[Callable[[], object]]:
    """A 4-byte all-reduce, then at each of GLOO_SIZES (the full buffer) an all-reduce, an all-gather,
    a reduce-scatter and an all-to-all."""
    import torch
    import torch.distributed as dist

    collectives: list[Callable[[], object]] = [lambda: dist.all_reduce(torch.ones(1))]
    for nbytes in GLOO_SIZES:
        full, shard, out = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world), torch.ones(nbytes // 4)
        collectives += [
            lambda full=full: dist.all_reduce(full),
            lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard),
            lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full),
            lambda full=full, out=out: dist.all_to_all_single(out, full),
        ]
    return collectives


def _gloo_collectives_worker(rank: int, world: int, port: int, seconds: float) -> str:
    """One of 2 ranks of the link measurement: mean seconds of each of `_collectives`, averaged over the
    ranks. Each rank computes a few ms between collectives, as a training step does, so the wait for a
    peer that arrives late is part of the cost. Means, not medians: that wait has a heavy tail, and a
    step pays the sum."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        a = torch.randn(256, 256)
        means = []
        for collective in _collectives(world):
            collective()  # warm up (connections, buffers)
            times, end = [], time.perf_counter() + seconds
            while True:
                for _ in range(20):  # ~0.7 GFLOP, a few ms between collectives
                    a @ a
                t0 = time.perf_counter()
                collective()
                times.append(time.perf_counter() - t0)
                if same_iteration_exit(end):
                    break
            means.append(statistics.fmean(times))
        averaged = torch.tensor(means, dtype=torch.float64)
        dist.all_reduce(averaged)
        return " ".join(str(x / world) for x in averaged.tolist())
    finally:
        leave_process_groups()


def measure_gloo_link(seconds: float = 0.6) -> dict[str, Any]:
    """The link fields of gloo between 2 local processes of 1 thread each (LinkConfig: latency_us, and
    all-reduce, all-gather, reduce-scatter and all-to-all GB/s at the largest size and `by_size`). Over
    2 ranks an all-reduce of n bytes takes n / bandwidth + 2 latency, the others n / 2 / their bandwidth
    + latency; the 4-byte all-reduce gives the latency. gloo needs its own number for each: its
    reduce-scatter all-reduces the whole buffer, so it takes as long as an all-reduce, not half. And per
    size: a few MiB reach half the bandwidth of 16 MiB, far more than the 4-byte latency explains."""
    small, *rest = map(float, run_ranks(_gloo_collectives_worker, 2, seconds).split())

    def gbs(nbytes: int, share: float, t: float) -> float:
        return share * nbytes / max(t - small * share, 1e-9) / 1e9

    times = [rest[4 * i : 4 * i + 4] for i in range(len(GLOO_SIZES))]
    largest = [gbs(GLOO_SIZES[-1], share, t) for share, t in zip(SHARES, times[-1])]
    # a smaller message never moves faster than the largest: a latency sample inflated by a busy
    # moment must not make a small collective free
    rows = [
        [float(nbytes), *(min(gbs(nbytes, share, t), top) for share, t, top in zip(SHARES, ts, largest))]
        for nbytes, ts in zip(GLOO_SIZES, times)
    ]
    # small / 2: the 4-byte all-reduce is all latency, 2 of them over 2 ranks (comm.hops(2) = 1)
    return {"latency_us": small / 2 * 1e6, **dict(zip(NAMES, largest)), "by_size": rows}


def link_probe() -> Probe:
    return Probe("gloo_collectives_by_size|world=2|threads=1", "links", 11.0, measure_gloo_link)


def gloo_link(cache_dir: str) -> dict[str, Any]:
    """The cpu profile's link fields (`measure_gloo_link`) between 2 workers of 1 thread, measured
    once, cached. More workers than cores share them: the planner scales these by the share (request.py)."""
    return dict(cached_measure(cache_dir, link_probe()))
