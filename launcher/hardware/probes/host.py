"""Host time that a CPU pays on top of its FLOPs (an accelerator's host runs ahead and hides it), each
measured with 1 thread:

- the tensor-parallel host overhead: DTensor's dispatch time per block and microbatch;
- the block host time: what one block's forward and backward cost when its FLOPs are negligible (the
  framework's dispatch of its ~100 ops, autograd's bookkeeping), per block and microbatch;
- the optimizer's host time per parameter: a fused AdamW step with gradient clipping (what every
  step runs once over the rank's parameters: ~3 ns per parameter here, streaming the parameter,
  its gradient and two moments through memory);
- the host copy time per byte: FSDP's copies around its collectives, into fresh pages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from launcher.compat.torch_compat import leave_process_groups
from launcher.config.model import ModelConfig
from launcher.flops import head_dim
from launcher.hardware.probes.cache import Probe, cached_measure
from launcher.hardware.probes.harness import median_seconds, run_ranks, torch_threads

COPY_BYTES = 2**26  # 64 MiB: above glibc's default mmap threshold (measure_host_copy)
BLOCK_PROBE_LAYERS = 4
TP_PROBE_LAYERS = 2


def _tp_probe_steps() -> list[Callable[[], None]]:
    """A train step of a model too small for its FLOPs to matter on plain tensors, then the same under
    the tensor-parallel plan on a 1-rank mesh (all of DTensor's dispatch, no peer to wait for)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from launcher.model.transformer import Transformer
    from launcher.parallel.tensor import apply_tensor_parallel, loss_context

    cfg = ModelConfig(
        name="probe", dim=64, n_layers=TP_PROBE_LAYERS, n_heads=4, ffn_dim=128, vocab_size=256, max_seq_len=16
    )
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
    return steps


def _tp_overhead_worker(rank: int, world: int, port: int, seconds: float) -> str:
    """Host seconds per tensor-parallel block and microbatch: the median step under the tensor-parallel
    plan minus the median plain step (`_tp_probe_steps`), over its blocks and one more (the
    embedding, output and loss as one)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        steps = _tp_probe_steps()
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
        return str(max(sharded_s - plain_s, 0.0) / (TP_PROBE_LAYERS + 1))
    finally:
        leave_process_groups()


def measure_tp_overhead(seconds: float = 1.0) -> float:
    """Microseconds of DTensor dispatch per tensor-parallel block and microbatch (fwd + bwd + optimizer)."""
    return float(run_ranks(_tp_overhead_worker, 1, seconds)) * 1e6


def measure_block_overhead(seconds: float = 1.0) -> float:
    """Microseconds of host time per block forward + backward, 1 thread: the blocks of a model too
    narrow for its FLOPs to matter (the `small` model's architecture at width 64, 8 tokens), the
    median step over `BLOCK_PROBE_LAYERS` blocks. A step of `small` at 2 x 256 tokens per microbatch
    costs this plus its FLOPs per block: the intercept of step time against tokens, measured."""
    import torch

    from launcher.model.attention import rope_tables
    from launcher.model.transformer import Block

    with torch_threads(1):
        cfg = ModelConfig(name="probe", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
        torch.manual_seed(0)
        blocks = [Block(cfg) for _ in range(BLOCK_PROBE_LAYERS)]
        rope = rope_tables(head_dim(cfg), 8, cfg.rope_theta, torch.device("cpu"))
        x = torch.randn(1, 8, cfg.dim)

        def step() -> None:
            h = x.requires_grad_()
            for block in blocks:
                h = block(h, rope)
            h.sum().backward()

        return median_seconds(step, seconds, warmup=5) / BLOCK_PROBE_LAYERS * 1e6


def measure_optimizer_step(seconds: float = 1.0, numel: int = 2**22) -> float:
    """Nanoseconds per parameter of a fused AdamW step after clipping the gradients' norm, 1 thread,
    on `numel` parameters in 16 tensors (larger than the caches: the step streams from memory)."""
    import torch

    with torch_threads(1):
        params = [torch.nn.Parameter(torch.randn(numel // 16)) for _ in range(16)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        return median_seconds(step, seconds, warmup=1) / numel * 1e9  # warm-up: the moments are allocated


def _host_copy_worker(rank: int, world: int, port: int, seconds: float) -> str:
    """`measure_host_copy` in a fresh interpreter under the allocator training runs with (rank, world and
    port unused)."""
    import torch

    from launcher.train.allocator import set_cpu_allocator

    set_cpu_allocator("fast")
    with torch_threads(1):
        src = torch.randn(COPY_BYTES // 4)
        parts = list(src.chunk(16))

        def step() -> None:
            torch.empty_like(src).copy_(src)
            torch.cat(parts)

        return str(median_seconds(step, seconds, warmup=2) / (2 * COPY_BYTES) * 1e9)


def measure_host_copy(seconds: float = 0.5) -> float:
    """Nanoseconds per byte written of the copies FSDP makes around its collectives (and MoE's routing),
    1 thread: a copy into a newly allocated tensor (the all-gather's copy-out into the unsharded
    parameters) and a cat of 16 pieces (the reduce-scatter's copy-in of the gradients), COPY_BYTES
    each, the median of the pair over the bytes, under `cpu_allocator=fast` as training runs: the
    freed blocks come back from glibc's heap, ~0.07 ns per byte here. Under glibc's defaults each block
    is mmapped fresh and faults its pages in, 10x that (0.72; the calibration measured this before
    training kept its blocks, and over-predicted FSDP's and MoE's host copies by as much)."""
    return float(run_ranks(_host_copy_worker, 1, seconds))


def tp_probe() -> Probe:
    return Probe("tp_dispatch_us|threads=1", "host", 5.0, measure_tp_overhead)


def block_probe() -> Probe:
    return Probe("block_host_us|threads=1", "host", 1.5, measure_block_overhead)


def optimizer_probe() -> Probe:
    return Probe("optimizer_ns_per_param|threads=1", "host", 2.0, measure_optimizer_step)


def copy_probe() -> Probe:
    return Probe("host_copy_ns_per_byte|threads=1", "host", 4.0, measure_host_copy)


def tp_overhead_us(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, tp_probe()))


def optimizer_ns_per_param(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, optimizer_probe()))


def host_copy_ns_per_byte(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, copy_probe()))


def block_overhead_us(cache_dir: str) -> float:
    return float(cached_measure(cache_dir, block_probe()))
