"""`python -m bench.gpu_fsdp RUN_DIR OVERRIDES...`: the FSDP2 half of gpu_check's loss comparison.

`train` shards with FSDP only over two or more ranks, and one GPU holds one NCCL rank, so this runs
the launcher's own pieces (model, FSDP2 wrapping with the cuda bf16 policy, runner, optimizer, data)
on a one-rank mesh, step by step as the loop does, and writes each step's loss to RUN_DIR/result.json.
On a CPU (gpu_check --rehearse) the same over gloo, in fp32.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from launcher.config.layout_keys import from_config
from launcher.config.precision import fsdp_policy
from launcher.config.schema import compose_config
from launcher.data import load_splits
from launcher.launch.rank_env import cuda_env_defaults
from launcher.layout import build_mesh
from launcher.metrics.meter import memory_gib
from launcher.model.init import materialize, meta_model
from launcher.parallel.data import shard_blocks
from launcher.parallel.runner import ParallelRunner
from launcher.planner import build_options
from launcher.train.optim import build_optimizer, optimizer_impl
from launcher.train.setup import loaders, pick_device


def main(run_dir: Path, overrides: list[str]) -> None:
    cfg = compose_config(*overrides)
    cuda_env_defaults(cfg.hardware.kind)
    layout = from_config(cfg, 1)
    options = build_options(cfg, layout)
    device = pick_device(options)  # cuda:0, or the CPU (gpu_check --rehearse: gloo, fp32)
    cuda = device.type == "cuda"
    backend = {"backend": "nccl", "device_id": device} if cuda else {"backend": "gloo"}
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **backend)
    mesh = build_mesh(layout, device.type)
    model = meta_model(cfg.model)
    shard_blocks(
        model, mesh["dp_shard"], reshard_after_forward=True, mp_policy=fsdp_policy("fsdp_bf16" if cuda else "fp32")
    )
    materialize([model], cfg.seed, device)
    runner = ParallelRunner([model], layout.micro, autocast=None, mesh=mesh, layout=layout, document_eos=None)
    optimizer, schedule = build_optimizer(runner.parts, cfg.optim, cfg.steps)
    train_loader, _ = loaders(layout, load_splits(cfg.data), options, 0)
    losses = {}
    for step in range(1, cfg.steps + 1):
        inputs, targets = train_loader.next_batch()
        losses[step] = runner.forward_backward(inputs.to(device), targets.to(device))
        runner.clip_grad_norm(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    result = {
        "losses": losses,
        "precision": "fsdp_bf16" if cuda else "fp32",
        "optimizer": optimizer_impl(optimizer),
        "peak_mem_gib": memory_gib(device),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
