"""Document-masked attention against plain causal attention at the same shapes, forward + backward:
`python -m bench.attention_mask [--seq-len 1024] [--doc-len 256] [--batch 2] [--heads 8] [--steps 5]`.

Rows: plain causal SDPA (`is_causal`, what an unmasked run does), SDPA with the dense document mask
(the CPU path of launcher/model/documents.py, mask built each step as the model does), and on CUDA
FlexAttention's block mask (compiled; the GPU path). The mask's cost is in the masked rows. Work
under the mask is the sum of squared document lengths (flops.document_span): a kernel that skips
masked blocks (flex) can beat causal; the dense mask cannot. The machine is shared: read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from launcher.flops import document_span
from launcher.model.documents import attention_mask, masked_attention


def timed(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Median seconds of `step` after one warm-up (compilation, caches)."""
    step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[tuple[str, float]]:
    b, h, s, d = args.batch, args.heads, args.seq_len, args.head_dim
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    docs = (torch.arange(s, device=device) // args.doc_len).expand(b, s)

    def causal() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def masked(flex: bool) -> Callable[[], None]:
        return lambda: masked_attention(q, k, v, attention_mask(docs, flex), 0.0).sum().backward()

    out = [("causal SDPA", timed(causal, args.steps, device))]
    out.append(("dense-mask SDPA", timed(masked(False), args.steps, device)))
    if device.type == "cuda":  # flex attention has no CPU backward (torch 2.13)
        out.append(("flex block mask", timed(masked(True), args.steps, device)))
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.attention_mask")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--doc-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    span = document_span([args.doc_len] * (args.seq_len // args.doc_len), args.seq_len)
    print(
        f"attention fwd+bwd on {device.type} ({dtype}): batch {args.batch}, heads {args.heads}, seq {args.seq_len}, "
        f"head_dim {args.head_dim}, documents of {args.doc_len} (span {span:.0f}: the masked work is "
        f"{span / args.seq_len:.2f} of causal's)"
    )
    results = rows(args, device, dtype)
    base = results[0][1]
    print(f"{'kernel':<18} {'ms/step':>9} {'vs causal':>10}")
    for name, seconds in results:
        print(f"{name:<18} {seconds * 1e3:9.2f} {seconds / base:9.2f}x")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
