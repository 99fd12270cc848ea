"""The MoE experts' two paths side by side (launcher/ops/experts.py), for gpu_check on CUDA.

The grouped GEMM against the loop over experts, both in bf16 on the same uneven groups (sizes not
multiples of 8, so the padding runs, and one expert without tokens): the largest difference of the
outputs and of every gradient relative to that tensor's largest entry, and the median time of a
forward + backward of each. Runs anywhere `torch._grouped_mm` does (tests/unit/test_gpu_check.py: CPU).

`python -m bench.gpu_moe OUT --experts=E --dim=D --hidden=H --rows=R` (gpu_check's moe check, in its own
process so the check's timeout holds): the comparison on CUDA (else the CPU), and which path the
launcher selects there, into OUT/result.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from launcher.ops.experts import grouped_swiglu, loop_swiglu, select_impl


def uneven_counts(experts: int, rows: int, generator: torch.Generator) -> list[int]:
    """`rows` split over the experts unevenly (a skewed router), the first expert left without any."""
    weights = torch.rand(experts, generator=generator) + 0.2
    weights[0] = 0
    counts = (weights / weights.sum() * rows).floor().long()
    counts[1] += rows - counts.sum()
    return counts.tolist()


def forward_backward_ms(
    fn: Any, inputs: list[torch.Tensor], counts: list[int], grad: torch.Tensor, repeats: int
) -> float:
    times = []
    for _ in range(repeats + 2):  # the first two: warm-up (allocator, kernel selection)
        if grad.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(inputs[0], counts, *inputs[1:]).backward(grad)
        if grad.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def compare_paths(
    device: torch.device, experts: int, dim: int, hidden: int, rows: int, repeats: int = 10
) -> dict[str, Any]:
    """{"counts", "max_rel_diff" (outputs, then each gradient), "loop_ms", "grouped_ms"}."""
    g = torch.Generator().manual_seed(0)
    counts = uneven_counts(experts, rows, g)
    shapes = [(rows, dim), (experts, dim, hidden), (experts, dim, hidden), (experts, hidden, dim)]
    base = [(torch.randn(s, generator=g) / s[-2] ** 0.5).to(device, torch.bfloat16) for s in shapes]
    grad = torch.randn(rows, dim, generator=g).to(device, torch.bfloat16)
    results = {}
    for name, fn in (("loop", loop_swiglu), ("grouped", grouped_swiglu)):
        inputs = [t.clone().requires_grad_() for t in base]
        out = fn(inputs[0], counts, *inputs[1:])
        out.backward(grad)
        results[name] = [out.detach(), *(t.grad for t in inputs)]
        results[f"{name}_ms"] = forward_backward_ms(fn, inputs, counts, grad, repeats)
    diffs = [
        ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()
        for got, want in zip(results["grouped"], results["loop"])
    ]
    return {"counts": counts, "max_rel_diff": diffs, "loop_ms": results["loop_ms"], "grouped_ms": results["grouped_ms"]}


def main(out: Path, shapes: dict[str, int]) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = compare_paths(device, **shapes)
    result["selected"] = select_impl(shapes["dim"], shapes["hidden"], device, bf16=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), {k.removeprefix("--"): int(v) for k, v in (a.split("=") for a in sys.argv[2:])})
