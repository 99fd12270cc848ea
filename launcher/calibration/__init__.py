"""CPU calibration: the numbers the `cpu` profile leaves null, measured on this machine.

- the GEMM peak: best fp32 matmul FLOP/s at the thread count a worker uses, the best of several
  trials after a warm-up (a peak is a maximum: a trial at a busy moment must not lower it), cached
  with when and how it was measured; a later measurement (`make bench`) that beats it by more than
  `PEAK_MARGIN` replaces it, with one line saying so;
- the sustained GEMM rate: the median trial with every core busy (one process of `threads` threads
  per `threads` cores, as the workers run; the best of 3 rounds), over the peak: the cpu profile's
  matmul efficiency. A
  lone core's best trial runs faster (turbo, a quiet moment) than training sustains: 220 vs
  185 GFLOP/s on this machine;
- the optimizer's host time per parameter: a fused AdamW step with gradient clipping (what every
  step runs once over the rank's parameters: ~3 ns per parameter here, streaming the parameter,
  its gradient and two moments through memory);
- the gloo link: latency, and all-reduce / all-gather / reduce-scatter / all-to-all bandwidth between 2
  local processes at three message sizes (gloo at a few MiB reaches about half its 16-MiB bandwidth);
- the host copy time per byte: FSDP's copies around its collectives, into fresh pages;
- the tensor-parallel host overhead: DTensor's dispatch time per block and microbatch;
- the block host time: what one block's forward and backward cost when its FLOPs are negligible (the
  framework's dispatch of its ~100 ops, autograd's bookkeeping): a CPU pays it per block and
  microbatch on top of the FLOPs, an accelerator's host runs ahead and hides it.

Each is measured once per machine (CPU model, torch version, threads) and cached in
`<cache_dir>/calibration.json`, so later runs start instantly. The multi-process harnesses run in
fresh interpreters. torch is imported only to measure.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from launcher.compat import leave_process_groups
from launcher.config import LauncherError, make_dir
from launcher.metrics.sinks import write_json

GLOO_SIZES = (2**18, 2**21, 2**24)  # 256 KiB to 16 MiB: what FSDP units, K/V and all-to-alls move
COPY_BYTES = 2**26  # fresh pages, as FSDP's buffers get (measure_host_copy)
GEMM_N, GEMM_TRIALS, GEMM_WARMUP_S, GEMM_ROUNDS = 1024, 5, 0.2, 3
BLOCK_PROBE_LAYERS = 4
PEAK_MARGIN = 0.10  # a later GEMM measurement this much above the cached peak replaces it


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


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}  # a corrupt cache is re-measured, never fatal


def _full_key(key: str) -> str:
    """A cache entry holds for one CPU model and torch version."""
    import torch

    return f"{cpu_model()}|torch={torch.__version__}|{key}"


def cached_measure(cache_dir: str, key: str, measure: Callable[[], Any]) -> Any:
    """Return the cached value for `key` on this machine, measuring (and caching) it once."""
    full_key = _full_key(key)
    path = _cache_file(cache_dir)
    cache = _read_cache(path)
    if full_key not in cache:
        make_dir(path.parent, "cache_dir")  # before measuring: a cache that cannot be written is bad input
        print(f"calibrating this machine, once: {key} (cached in {path})", file=sys.stderr, flush=True)
        cache[full_key] = measure()
        write_json(path, cache)
    return cache[full_key]


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the duration."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _gemm_rates(n: int, seconds: float, rounds: int, pause: float) -> Iterator[list[float]]:
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
    4-matmul time of `trials` trials (`_gemm_rates`)."""
    with _threads(threads):
        return max(max(rates) for rates in _gemm_rates(n, seconds, trials, pause=0.05))


def _gemm_worker(rank: int, world: int, port: int, seconds: float) -> str:
    """One of `world` processes running GEMMs at once: its median trial, FLOP/s, in the best of
    GEMM_ROUNDS rounds (as for the peak, a round at a moment another job is busy must not lower it;
    rank and port unused)."""
    import torch

    torch.set_num_threads(int(os.environ.get("LAUNCHER_GEMM_THREADS", "1")))
    return str(max(statistics.median(rates) for rates in _gemm_rates(GEMM_N, seconds, GEMM_ROUNDS, pause=0.2)))


def measure_gemm_sustained(threads: int, seconds: float = 2.4) -> float:
    """Median fp32 GEMM FLOP/s of one of the processes filling the cores (`threads` threads each)."""
    procs = max(1, (os.cpu_count() or 1) // threads)
    return float(_run_ranks("_gemm_worker", procs, seconds, {"LAUNCHER_GEMM_THREADS": str(threads)}))


def gemm_efficiency(threads: int, cache_dir: str) -> float:
    """The sustained GEMM rate with every core busy over the peak (at most 1), measured once, cached."""
    key = f"gemm_fp32_sustained|threads={threads}"
    sustained = float(cached_measure(cache_dir, key, lambda: measure_gemm_sustained(threads)))
    return min(1.0, sustained / gemm_flops(threads, cache_dir))


def _gemm_key(threads: int) -> str:
    return f"gemm_fp32|threads={threads}"


def gemm_record(threads: int, flops: float | None = None) -> dict[str, Any]:
    """A cache entry for the GEMM peak: the value, when and how it was measured."""
    how = f"best of {GEMM_TRIALS} trials, {GEMM_N}^3 fp32 matmuls, {threads} threads, after {GEMM_WARMUP_S} s warm-up"
    value = measure_gemm_flops(threads) if flops is None else flops
    return {"flops": value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "how": how}


def _flops(entry: Any) -> float:
    return float(entry["flops"] if isinstance(entry, dict) else entry)  # older caches: a bare number


def gemm_flops(threads: int, cache_dir: str) -> float:
    """The CPU's practical fp32 peak at `threads` threads, measured once, cached."""
    return _flops(cached_measure(cache_dir, _gemm_key(threads), lambda: gemm_record(threads)))


def cached_gemm_flops(threads: int, cache_dir: str) -> float | None:
    """The cached GEMM peak at `threads` threads, or None when this machine was never calibrated (no measuring)."""
    entry = _read_cache(_cache_file(cache_dir)).get(_full_key(_gemm_key(threads)))
    return None if entry is None else _flops(entry)


def offer_gemm_peak(threads: int, cache_dir: str, measured: float) -> str | None:
    """A later GEMM measurement: when it beats the cached peak by more than PEAK_MARGIN, it replaces it
    (the cached one was taken at a busy moment, and inflated every MFU since); the one line saying so."""
    path = _cache_file(cache_dir)
    cache = _read_cache(path)
    full_key = _full_key(_gemm_key(threads))
    if full_key not in cache or measured <= _flops(cache[full_key]) * (1 + PEAK_MARGIN):
        return None
    old = _flops(cache[full_key])
    cache[full_key] = gemm_record(threads, measured)
    write_json(path, cache)
    return f"GEMM peak at {threads} threads raised from {old / 1e9:.0f} to {measured / 1e9:.0f} GFLOP/s (in {path})"


def _same_iteration_exit(end: float) -> bool:
    """True on every rank once any rank is past `end`, so all leave a timing loop together."""
    import torch
    import torch.distributed as dist

    done = torch.tensor([1.0 if time.perf_counter() > end else 0.0])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return done.item() > 0


def _gloo_collectives_worker(rank: int, world: int, port: int, seconds: float) -> str:
    """One of 2 ranks of the link measurement: mean seconds of a 4-byte all-reduce, then at each of
    GLOO_SIZES (the full buffer) of an all-reduce, an all-gather, a reduce-scatter and an all-to-all,
    averaged over the ranks. Each rank computes a few ms between collectives, as a training step does,
    so the wait for a peer that arrives late is part of the cost. Means, not medians: that wait has a
    heavy tail, and a step pays the sum."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        a = torch.randn(256, 256)
        collectives: list[Callable[[], object]] = [lambda: dist.all_reduce(torch.ones(1))]
        for nbytes in GLOO_SIZES:
            full, shard, out = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world), torch.ones(nbytes // 4)
            collectives += [
                lambda full=full: dist.all_reduce(full),
                lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard),
                lambda full=full, shard=shard: dist.reduce_scatter_tensor(shard, full),
                lambda full=full, out=out: dist.all_to_all_single(out, full),
            ]
        means = []
        for collective in collectives:
            collective()  # warm up (connections, buffers)
            times, end = [], time.perf_counter() + seconds
            while True:
                for _ in range(20):  # ~0.7 GFLOP, a few ms between collectives
                    a @ a
                t0 = time.perf_counter()
                collective()
                times.append(time.perf_counter() - t0)
                if _same_iteration_exit(end):
                    break
            means.append(statistics.fmean(times))
        averaged = torch.tensor(means, dtype=torch.float64)
        dist.all_reduce(averaged)
        return " ".join(str(x / world) for x in averaged.tolist())
    finally:
        leave_process_groups()


def _tp_overhead_worker(rank: int, world: int, port: int, seconds: float) -> str:
    """Host seconds per tensor-parallel block and microbatch: a train step of a 2-layer model too small
    for its FLOPs to matter, under the tensor-parallel plan on a 1-rank mesh (all of DTensor's dispatch,
    no peer to wait for) minus the same step on plain tensors, over 3 blocks (2 layers + embedding,
    output and loss as one)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from launcher.config import ModelConfig
    from launcher.model.transformer import Transformer
    from launcher.parallel.tensor import apply_tensor_parallel, loss_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(name="probe", dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=256, max_seq_len=16)
        torch.manual_seed(0)
        plain, sharded = Transformer(cfg), Transformer(cfg)
        apply_tensor_parallel(sharded, init_device_mesh("cpu", (1,)), sequence_parallel=False)
        tokens = torch.randint(0, cfg.vocab_size, (1, 9))
        steps = []
        for model, tp in ((plain, 1), (sharded, 2)):
            opt = torch.optim.AdamW(model.parameters(), foreach=True)

            def step(model: torch.nn.Module = model, tp: int = tp, opt: torch.optim.Optimizer = opt) -> None:
                with loss_context(tp):
                    logits = model(tokens[:, :-1])
                    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            steps.append(step)
        times: list[list[float]] = [[], []]
        for fn in steps:
            fn()  # warm up: DTensor's sharding-propagation cache
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # alternate, so drift hits both alike
            for i, fn in enumerate(steps):
                t0 = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - t0)
        plain_s, sharded_s = (statistics.median(t) for t in times)
        return str(max(sharded_s - plain_s, 0.0) / (cfg.n_layers + 1))
    finally:
        leave_process_groups()


def _median_seconds(step: Callable[[], None], seconds: float, warmup: int) -> float:
    """Median seconds of `step` over `seconds` of calls, after `warmup` calls."""
    for _ in range(warmup):
        step()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_block_overhead(seconds: float = 1.0) -> float:
    """Microseconds of host time per block forward + backward, 1 thread: the blocks of a model too
    narrow for its FLOPs to matter (the `small` model's architecture at width 64, 8 tokens), the
    median step over `BLOCK_PROBE_LAYERS` blocks. A step of `small` at 2 x 256 tokens per microbatch
    costs this plus its FLOPs per block: the intercept of step time against tokens, measured."""
    import torch

    from launcher.config import ModelConfig
    from launcher.model.transformer import Block, rope_tables

    with _threads(1):
        cfg = ModelConfig(name="probe", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
        torch.manual_seed(0)
        blocks = [Block(cfg) for _ in range(BLOCK_PROBE_LAYERS)]
        rope = rope_tables(cfg.dim // cfg.n_heads, 8, cfg.rope_theta, torch.device("cpu"))
        x = torch.randn(1, 8, cfg.dim)

        def step() -> None:
            h = x.requires_grad_()
            for block in blocks:
                h = block(h, rope)
            h.sum().backward()

        return _median_seconds(step, seconds, warmup=5) / BLOCK_PROBE_LAYERS * 1e6


def measure_optimizer_step(seconds: float = 1.0, numel: int = 2**22) -> float:
    """Nanoseconds per parameter of a fused AdamW step after clipping the gradients' norm, 1 thread,
    on `numel` parameters in 16 tensors (larger than the caches: the step streams from memory)."""
    import torch

    with _threads(1):
        params = [torch.nn.Parameter(torch.randn(numel // 16)) for _ in range(16)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        return _median_seconds(step, seconds, warmup=1) / numel * 1e9  # warm-up: the moments are allocated


def measure_host_copy(seconds: float = 0.5) -> float:
    """Nanoseconds per byte written of the copies FSDP makes around its collectives, 1 thread: a copy
    into a freshly allocated tensor (the all-gather's copy-out into the unsharded parameters) and a
    cat of 16 pieces (the reduce-scatter's copy-in of the gradients), COPY_BYTES each, the median of
    the pair over the bytes. A block that size is mmap'd fresh each time and faults its pages in
    (~2.5 GB/s here), as FSDP's gathered and gradient buffers do in a training run: moe_small at
    dp=2 (torch.profiler, one step) spends 85 ms in `copy_` and 35 ms in `cat` on ~258 MB, 2.2 GB/s,
    although a tight loop of fresh 8 MiB tensors gets reused heap memory from glibc at ~14 GB/s."""
    import torch

    with _threads(1):
        src = torch.randn(COPY_BYTES // 4)
        parts = list(src.chunk(16))

        def step() -> None:
            torch.empty_like(src).copy_(src)
            torch.cat(parts)

        return _median_seconds(step, seconds, warmup=2) / (2 * COPY_BYTES) * 1e9


def _run_ranks(worker: str, world: int, seconds: float, extra_env: dict[str, str] | None = None) -> str:
    """Run `launcher.calibration.<worker>(rank, world, port, seconds)` in `world` fresh interpreters (not
    multiprocessing: this works from any entry point, inside a process group or not); rank 0's result."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        f"import sys; from launcher.calibration import {worker} as w; print(w(*map(int, sys.argv[1:4]), {seconds!r}))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path]))
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
            out, err = p.communicate(timeout=120)
            if p.returncode:
                raise LauncherError(f"cpu calibration ({worker}) failed: {err.strip().splitlines()[-1:]}")
            outs.append(out)
    except subprocess.TimeoutExpired as e:
        raise LauncherError(f"cpu calibration ({worker}) timed out: give the cpu profile's numbers") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs[0].strip().splitlines()[-1]


def measure_gloo_link(seconds: float = 0.6) -> dict[str, Any]:
    """The link fields of gloo between 2 local processes of 1 thread each (LinkConfig: latency_us, and
    all-reduce, all-gather, reduce-scatter and all-to-all GB/s at the largest size and `by_size`), as
    the planner's collective model reads them (launcher/planner/comm.py). Over 2 ranks an all-reduce
    of n bytes takes n / bandwidth + 2 latency, the others n / 2 / their bandwidth + latency; the
    4-byte all-reduce gives the latency. gloo needs its own number for each: its reduce-scatter
    all-reduces the whole buffer, so it takes as long as an all-reduce, not half. And per size: a few
    MiB reach half the bandwidth of 16 MiB, far more than the 4-byte latency explains."""
    small, *rest = map(float, _run_ranks("_gloo_collectives_worker", 2, seconds).split())

    def gbs(nbytes: int, share: float, t: float) -> float:
        return share * nbytes / max(t - small * share, 1e-9) / 1e9

    shares = (1.0, 0.5, 0.5, 0.5)  # all-reduce, all-gather, reduce-scatter, all-to-all
    times = [rest[4 * i : 4 * i + 4] for i in range(len(GLOO_SIZES))]
    largest = [gbs(GLOO_SIZES[-1], share, t) for share, t in zip(shares, times[-1])]
    # a smaller message never moves faster than the largest: a latency sample inflated by a busy
    # moment must not make a small collective free
    rows = [
        [float(nbytes), *(min(gbs(nbytes, share, t), top) for share, t, top in zip(shares, ts, largest))]
        for nbytes, ts in zip(GLOO_SIZES, times)
    ]
    names = ("bandwidth_gbs", "all_gather_gbs", "reduce_scatter_gbs", "all_to_all_gbs")
    # small / 2: the 4-byte all-reduce is all latency, 2 of them over 2 ranks (comm.hops(2) = 1)
    return {"latency_us": small / 2 * 1e6, **dict(zip(names, largest)), "by_size": rows}


def measure_tp_overhead(seconds: float = 1.0) -> float:
    """Microseconds of DTensor dispatch per tensor-parallel block and microbatch (fwd + bwd + optimizer)."""
    return float(_run_ranks("_tp_overhead_worker", 1, seconds)) * 1e6


def gloo_link(cache_dir: str) -> dict[str, Any]:
    """The cpu profile's link fields (`measure_gloo_link`) between 2 workers of 1 thread, measured
    once, cached. More workers than cores share them: the planner scales these by the share (request.py)."""
    return dict(cached_measure(cache_dir, "gloo_collectives_by_size|world=2|threads=1", measure_gloo_link))


def tp_overhead_us(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, "tp_dispatch_us|threads=1", measure_tp_overhead))


def optimizer_ns_per_param(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, "optimizer_ns_per_param|threads=1", measure_optimizer_step))


def host_copy_ns_per_byte(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, "host_copy_ns_per_byte|threads=1", measure_host_copy))


def block_overhead_us(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, "block_host_us|threads=1", measure_block_overhead))
