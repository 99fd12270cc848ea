"""gpu_check's `fp8` row: the throughput model (`1b`, compile) under dtype=fp8 against bf16 over the
same steps: tokens/s side by side, and every step's loss within FP8_LOSS_RTOL of bf16's. The bf16
side is the throughput check's run when it ran the same arguments (on a GPU) and logged steps past the
warm-up, even if it was cut short (the fp8 run is compared over the steps both have), else its own run.
On the CPU rehearsal: the tiny model with torchao's emulation and the shape filter lowered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gpu_runs import Check, Clock, Target, close, losses, median, metrics, train_cli

# float8 e4m3 casts in every block's matmuls, 30 steps from initialization: torchao's published loss
# curves stay within about a percent of bf16; twice that catches a broken cast or scale
FP8_LOSS_RTOL = 2e-2


def logged(run: Path) -> list[dict[str, Any]]:
    """A run's metrics rows so far (none when it logged nothing)."""
    return metrics(run) if (run / "metrics.jsonl").exists() else []


def bf16_args(big: tuple[str, ...]) -> tuple[str, ...]:
    return (*(a for a in big if not a.startswith("dtype=")), "dtype=bf16")


def fp8_vs_bf16(out: Path, t: Target, clock: Clock) -> list[Check]:
    runs: dict[str, tuple[Path, dict[str, Any]]] = {}
    reuse = out / "throughput"
    if t.big == bf16_args(t.big) and any(r["step"] > t.warmup for r in logged(reuse)):
        runs["bf16"] = reuse, {}
    for dtype, args in (("bf16", bf16_args(t.big)), ("fp8", (*bf16_args(t.big)[:-1], *t.fp8))):
        if dtype in runs:
            continue
        rc, summary, why = train_cli(out / f"fp8_{dtype}", t, clock, *args, "checkpoint.every=0")
        if rc:
            return [Check(f"fp8: {dtype} run", "FAIL", f"exit {rc}: {why}")]
        runs[dtype] = out / f"fp8_{dtype}", summary

    both = {r["step"] for r in metrics(runs["fp8"][0])} & {r["step"] for r in metrics(runs["bf16"][0])}

    def timed(dtype: str, key: str) -> float:
        return median([r[key] for r in metrics(runs[dtype][0]) if r["step"] > t.warmup and r["step"] in both])

    ok, worst = close(losses(runs["fp8"][0]), losses(runs["bf16"][0]), FP8_LOSS_RTOL)
    speedup = timed("fp8", "tokens_per_s") / timed("bf16", "tokens_per_s")
    converted = sum((runs["fp8"][1].get("fp8") or {}).get("converted", {}).values())
    fp8_mfu = runs["fp8"][1].get("median_mfu_fp8_peak")
    note = f"{speedup:.2f}x bf16 tokens/s ({timed('bf16', 'tokens_per_s'):,.0f}); losses within {worst:.1e} "
    note += f"(tolerance {FP8_LOSS_RTOL:.0e}); {converted} layers fp8"
    note += f"; MFU vs fp8 peak {fp8_mfu:.1%}" if fp8_mfu is not None else ""
    figures = {"tokens_per_s": timed("fp8", "tokens_per_s"), "tflops": timed("fp8", "tflops_per_device")}
    figures |= {"mfu": timed("fp8", "mfu"), "peak_gib": runs["fp8"][1].get("peak_mem_gib")}
    return [Check("fp8: fp8 vs bf16", "ok" if ok else "FAIL", note, figures)]
