"""A bare, hand-written training loop: the baseline the launcher's overhead is measured against.

The same work per step as `train` on one process, none of the launcher (no Hydra, metrics sinks,
console, runner, guard or checkpoints): same model, data, threads, loss (the chunked one,
`model(x, y)`), fused AdamW with weight decay on matrices only and the launcher's learning-rate
schedule set by hand each step, gradients clipped to norm 1 (the launcher's default), one host read
of the loss. Prints the wall-clock time at the end of every step as JSON: the overhead bench takes
the same statistic of these as of the launcher's own step ends.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from launcher.config.model import ModelConfig
from launcher.config.schema import DataConfig, OptimConfig
from launcher.data import BatchLoader, load_splits
from launcher.model.init import initialized_model
from launcher.train.optim import lr_factor


def main(steps: int, micro: int, seq_len: int, threads: int, cache_dir: str) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = initialized_model(ModelConfig(), 0, torch.device("cpu"))
    cfg = OptimConfig()
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    loader = BatchLoader(load_splits(DataConfig(cache_dir=cache_dir)).train, seq_len, micro, seed=0)
    ends = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step, cfg, steps)
        x, y = loader.next_batch()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        ends.append(time.time())
    print(json.dumps({"step_ends": ends}))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), sys.argv[5])
