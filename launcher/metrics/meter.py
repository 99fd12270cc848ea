"""Per-step figures: tokens/s, model TFLOP/s per device, MFU and memory (FLOPs from flops.py)."""

from __future__ import annotations

import resource
import sys
import time

import torch

from launcher.flops import GIB, mfu


def memory_gib(device: torch.device) -> float:
    """Peak memory of this worker, as the planner predicts it (tensors + overhead). CUDA: the device
    memory it held at its peak: the caching allocator's peak reservation, plus what lives outside the
    allocator (the CUDA context, NCCL's buffers), measured now as the device's used memory less the
    reservation (cudaMemGetInfo: the GPU assumed to be this process's alone). CPU: the process's peak
    resident set less its mapped files now (`mapped_files_kib`)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = max(0, total - free - torch.cuda.memory_reserved(device))
        return (torch.cuda.max_memory_reserved(device) + outside) / GIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    if sys.platform == "darwin":
        return peak / GIB
    return (peak - mapped_files_kib()) / 2**20


def mapped_files_kib() -> int:
    """The resident pages of the files this process maps (torch's libraries, the memory-mapped corpus), KiB: clean,
    shared by every rank on the machine and reclaimable, and their count is the page cache's, not the run's (on
    Linux 6.x a library freshly written to disk is cached in large folios: the same `import torch` maps 220 or 280
    MiB). The peak resident set less these is the run's own memory, the same on every machine (within the pages
    first read after the peak: the libraries are mapped, and mostly read, at import)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))
    except (OSError, StopIteration):  # no procfs
        return 0


def memory_measure(device: torch.device) -> str:
    """What `memory_gib` measures, in words (summary.json's `peak_mem_measure`)."""
    if device.type == "cuda":
        return "device memory: allocator peak reserved + CUDA context and NCCL buffers (mem_get_info)"
    return "process peak resident set less mapped files"


class Meter:
    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float,
        world_size: int,
        device: torch.device,
        peak_flops_fp8: float = 0.0,
    ) -> None:
        """`peak_flops`: MFU's denominator, the bf16 peak for every dtype (comparable across runs);
        `peak_flops_fp8` (dtype=fp8 on a profile with float8 units): `mfu_fp8_peak`'s, 0 for none."""
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.peak_flops_fp8 = peak_flops_fp8
        self.world_size = world_size
        self.device = device
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, step: int, loss: float, lr: float, grad_norm: float) -> dict[str, float]:
        """Close the step begun by `start` (the caller synchronises the device first)."""
        dt = time.perf_counter() - self._t0
        tokens_per_s = self.tokens_per_step / dt
        per_device = tokens_per_s / self.world_size
        row = {
            "step": step,
            "time": time.time(),
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": dt,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": per_device * self.flops_per_token / 1e12,
            "mfu": mfu(per_device, self.flops_per_token, self.peak_flops),
            "mem_gib": memory_gib(self.device),
        }
        if self.peak_flops_fp8 > 0:
            row["mfu_fp8_peak"] = mfu(per_device, self.flops_per_token, self.peak_flops_fp8)
        if self.device.type == "cuda":  # the tensors' own peak, inside mem_gib's device figure
            row["mem_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
        return row
