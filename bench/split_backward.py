"""Zero-bubble schedules' split backward on the CPU: `python -m bench split_backward [--trials 20]`.

torch's stage_backward_input (gradients of the stage input only) then stage_backward_weight, against one
backward, on the `small` model's 2-block stage (micro 2 x 256, 1 thread), best of `trials`, side by side.
Their ratio is the planner's SPLIT_BACKWARD_CPU (launcher/planner/compute.py).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from bench.planner_accuracy import resolved_config
from launcher.flops import head_dim
from launcher.model.attention import rope_tables
from launcher.model.transformer import Block
from launcher.parallel.pipeline import split_weight_passes


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench split_backward", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = resolved_config(1, 1, 1, 256, 2).model
    blocks = torch.nn.ModuleList(Block(m, layer) for layer in range(2))
    split_blocks = copy.deepcopy(blocks)  # the same weights, their fused projections split
    split_weight_passes(split_blocks)
    rope = rope_tables(head_dim(m), 256, m.rope_theta, torch.device("cpu"))
    x0, dy = torch.randn(2, 256, m.dim), torch.randn(2, 256, m.dim)

    def forward(blocks: torch.nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        h = x
        for block in blocks:
            h = block(h, rope)
        return x, h

    def whole() -> tuple[float, float]:  # one node per fused projection, as outside zero-bubble schedules
        _, h = forward(blocks)
        start = time.perf_counter()
        h.backward(dy)
        return time.perf_counter() - start, 0.0

    def split() -> tuple[float, float]:
        x, h = forward(split_blocks)
        start = time.perf_counter()
        _, groups = stage_backward_input([h], [dy], [x], iter(split_blocks.parameters()))
        mid = time.perf_counter()
        stage_backward_weight(iter(split_blocks.parameters()), groups)
        return mid - start, time.perf_counter() - mid

    def timed(fn: Callable[[], tuple[float, float]]) -> tuple[float, float]:
        for p in (*blocks.parameters(), *split_blocks.parameters()):
            p.grad = None
        return fn()

    trials = [(timed(whole), timed(split)) for _ in range(args.trials)]  # interleaved: the same machine state
    full = min(t[0][0] for t in trials)
    inp, weight = min((t[1] for t in trials), key=sum)
    print(
        f"split backward (small, 2 blocks, 2 x 256, 1 thread, best of {args.trials}): one backward "
        f"{full * 1e3:.1f} ms; input {inp * 1e3:.1f} + weight {weight * 1e3:.1f} = {(inp + weight) * 1e3:.1f} ms, "
        f"ratio {(inp + weight) / full:.2f}"
    )
