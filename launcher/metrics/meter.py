"""Per-step figures: tokens/s, model TFLOP/s per device, MFU and memory (FLOPs from flops.py)."""

from __future__ import annotations

import resource
import sys
import time

import torch

from launcher.flops import GIB, mfu


def memory_gib(device: torch.device) -> float:
    """Peak memory of this worker: CUDA allocator peak, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (GIB if sys.platform == "darwin" else 2**20)


class Meter:
    def __init__(
        self, tokens_per_step: int, flops_per_token: float, peak_flops: float, world_size: int, device: torch.device
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
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
        if self.device.type == "cuda":  # what the caching allocator holds, beside what tensors use
            row["mem_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
        return row
