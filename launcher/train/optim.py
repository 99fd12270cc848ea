"""AdamW (no decay on norms and biases) and the warmup + cosine learning-rate schedule.

The update runs fused (one kernel for every parameter's update) where every parameter is a floating
tensor on a device torch has the kernel for (CPU and CUDA), DTensor shards included (torch registers
`_fused_adamw_` as a pointwise DTensor op); elsewhere, multi-tensor `foreach`. On this CPU the fused
step of a 6M-parameter model took 15-20 ms against 70-90 ms for `foreach`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from launcher.config.schema import OptimConfig


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at `step` (0-based): linear warmup, then cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


FUSED_DEVICES = ("cpu", "cuda")  # where torch 2.13 has `_fused_adamw_`


def fused_capable(p: torch.Tensor) -> bool:
    return p.device.type in FUSED_DEVICES and p.is_floating_point()


def adamw_impl(params: list[torch.Tensor], fusable: Callable[[torch.Tensor], bool] = fused_capable) -> str:
    """fused | foreach: fused only when every parameter can take it (torch refuses a mix)."""
    return "fused" if params and all(fusable(p) for p in params) else "foreach"


def build_optimizer(
    parts: list[nn.Module], cfg: OptimConfig, total_steps: int, fusable: Callable[[torch.Tensor], bool] = fused_capable
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = {adamw_impl(params, fusable): True}  # fused=True or foreach=True
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))
    return optimizer, schedule


def optimizer_impl(optimizer: torch.optim.Optimizer) -> str:
    """The implementation `build_optimizer` chose, for the summary."""
    return "fused" if optimizer.defaults.get("fused") else "foreach"
