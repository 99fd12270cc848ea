"""`make gpu-check` (`python -m bench gpu_check [--hardware=NAME] [--out=DIR]`): the CUDA path on one GPU.

In a few minutes, through the `train` command a user runs (each run's summary.json and metrics.jsonl):
1. `1b`, 30 steps of 8 x 2048 tokens, bf16 + compile: tokens/s, TFLOP/s and MFU against the profile's peak (goal on an
   H100/H200: MFU >= 55%);
2. `125m` with FSDP2 (its bf16 MixedPrecisionPolicy, fused AdamW over DTensor shards) against the
   same steps without FSDP (bf16 autocast): losses equal within bf16 tolerance. `train` never shards
   over one rank, so this one run goes through the Python API on a one-rank mesh;
3. a checkpoint saved on the GPU and reloaded: the resumed run's next losses equal the original's;
4. `8b` with `steps=0`: every shard allocated for real, measured memory beside the planner's;
5. `125m` with `profile.start=2 profile.memory=true`: a CUDA trace and a memory snapshot are written;
6. the MoE experts' grouped GEMM (`torch._grouped_mm`) against the loop over experts on a Qwen3-30B-A3B
   layer's shapes (bench/gpu_moe.py): bf16 outputs and gradients within GROUPED_RTOL of the largest
   entry, and the forward + backward time of each; then `moe_small` in bf16 trains on it
   (`expert_impl` in its summary).
Measured peak memory is printed beside the planner's prediction for each. Exit 1 if any check fails
or there is no CUDA device (one line, at once).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# device name (torch.cuda.get_device_name) → hardware profile; anything else: h100_sxm
PROFILES = (("H200", "h200"), ("H100", "h100_sxm"), ("A100", "a100"), ("B200", "b200"), ("V100", "v100_dgx2"))
QUIET = ("eval.every=0", "metrics.wandb.mode=disabled", "metrics.console=plain", "resume=never")
SMALL = ("+model=125m", "steps=10", "seq_len=1024", "batch.micro=8", "compile=false", "optim.warmup_steps=2")
LOSS_RTOL = 1e-2  # FSDP's bf16 parameters vs autocast's bf16 casts: the same math, rounded differently
RESUME_RTOL = 1e-3  # the same state on the same GPU: equal up to kernel non-determinism
GROUPED_RTOL = 2e-2  # bf16 both ways, summed in another order: a few bf16 ulps of the largest entry


@dataclass
class Check:
    name: str
    ok: bool
    note: str
    summary: dict[str, Any] = field(default_factory=dict)


def profile_for(device_name: str) -> str:
    return next((profile for key, profile in PROFILES if key in device_name.upper()), "h100_sxm")


def on_one_gpu(hw: str) -> tuple[str, str]:
    """The profile, on one of its devices (a GPU profile's world is otherwise its whole node)."""
    return f"hardware={hw}", "hardware.devices_per_node=1"


def train_cli(run_dir: Path, *overrides: str, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    """`train` as a user runs it: (exit code, summary.json or {}, the last line it printed)."""
    cmd = [str(Path(sys.executable).with_name("train")), f"run_dir={run_dir}", *QUIET, *overrides]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, {}, f"timed out after {timeout:.0f} s"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.out").write_text(proc.stdout + proc.stderr)
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return proc.returncode, summary, lines[-1] if lines else ""


def step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def close(a: dict[int, float], b: dict[int, float], rtol: float) -> tuple[bool, float]:
    """Whether every common step's losses agree within `rtol`, and the worst relative difference."""
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in a.keys() & b.keys())
    return worst <= rtol, worst


def throughput(out: Path, hw: str) -> Check:
    rc, summary, last = train_cli(
        out / "1b", "+model=1b", *on_one_gpu(hw), "steps=30", "seq_len=2048", "batch.micro=8",
        "compile=true", "dtype=bf16", "checkpoint.every=0",
    )  # fmt: skip
    if rc:
        return Check("1b bf16 + compile", False, f"exit {rc}: {last}")
    mfu = summary["median_mfu"]
    return Check("1b bf16 + compile", True, f"MFU {mfu:.1%} (goal >= 55%), {summary['precision']}", summary)


def fsdp_equality(out: Path, hw: str) -> tuple[Check, Check]:
    """125m without FSDP (checkpoints at 5 and 10), with FSDP, and resumed from step 5."""
    ref_dir = out / "125m"
    rc, reference, last = train_cli(ref_dir, *SMALL, *on_one_gpu(hw), "checkpoint.every=5")
    if rc:
        failed = Check("125m reference", False, f"exit {rc}: {last}")
        return failed, failed
    fsdp_dir = out / "125m_fsdp"
    worker = [sys.executable, "-m", "bench.gpu_fsdp", str(fsdp_dir), *SMALL, *on_one_gpu(hw)]
    proc = subprocess.run(worker, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        fsdp = Check("125m FSDP2 = no FSDP", False, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    else:
        result = json.loads((fsdp_dir / "result.json").read_text())
        ok, worst = close({int(k): v for k, v in result["losses"].items()}, step_losses(ref_dir), LOSS_RTOL)
        note = f"losses within {worst:.1e} (tolerance {LOSS_RTOL:.0e}), {result['precision']}, {result['optimizer']}"
        fsdp = Check("125m FSDP2 = no FSDP", ok, note, {"peak_mem_gib": result["peak_mem_gib"]})
    resumed_dir = out / "125m_resumed"
    checkpoint = ref_dir / "checkpoints" / "step_00000005"
    rc, resumed, last = train_cli(resumed_dir, *SMALL, *on_one_gpu(hw), f"resume={checkpoint}", "checkpoint.every=0")
    if rc:
        return fsdp, Check("checkpoint save + resume", False, f"exit {rc}: {last}")
    ok, worst = close(step_losses(resumed_dir), step_losses(ref_dir), RESUME_RTOL)
    note = f"steps 6-10 after resuming step 5: within {worst:.1e} (tolerance {RESUME_RTOL:.0e})"
    return fsdp, Check("checkpoint save + resume", ok, note, resumed)


def build_only(out: Path, hw: str) -> Check:
    """8b, steps=0: the real build of every shard (force: one GPU cannot train 8b, it can hold it)."""
    rc, summary, last = train_cli(out / "8b", "+model=8b", *on_one_gpu(hw), "steps=0", "force=true")
    if rc:
        return Check("8b steps=0", False, f"exit {rc}: {last}")
    return Check("8b steps=0", True, last, summary)


def profiled(out: Path, hw: str) -> Check:
    """profile.memory=true: the Chrome trace (with CUDA kernels) and the allocator snapshot."""
    run = out / "125m_profile"
    rc, summary, last = train_cli(run, *SMALL, *on_one_gpu(hw), "steps=3", "profile.start=2", "profile.memory=true")
    if rc:
        return Check("profile + memory snapshot", False, f"exit {rc}: {last}")
    files = sorted(p.name for p in (run / "profile").iterdir())
    ok = files == ["rank0.memory.pickle", "rank0.trace.json"] and "CUDA" in summary.get("profile", [""])[0]
    return Check("profile + memory snapshot", ok, f"{files}; {summary.get('profile', ['-'])[0][:90]}")


def grouped_gemm(out: Path, hw: str) -> tuple[Check, Check]:
    """128 experts of 2048 x 768 over 4096 tokens x top-8 (Qwen3-30B-A3B, one layer, ep=1), then moe_small."""
    import torch

    from bench.gpu_moe import compare_paths
    from launcher.model.experts import Experts, select_impl

    device = torch.device("cuda")
    selected = select_impl(Experts(128, 2048, 768), device, bf16=True)
    r = compare_paths(device, experts=128, dim=2048, hidden=768, rows=4096 * 8)
    worst = max(r["max_rel_diff"])
    note = (
        f"{selected}; outputs, grads within {worst:.1e} (tolerance {GROUPED_RTOL:.0e}); fwd+bwd "
        f"loop {r['loop_ms']:.2f} ms, grouped {r['grouped_ms']:.2f} ms ({r['loop_ms'] / r['grouped_ms']:.1f}x)"
    )
    kernel = Check("MoE grouped GEMM = loop", selected == "grouped_mm" and worst <= GROUPED_RTOL, note)
    rc, summary, last = train_cli(
        out / "moe_small", "+model=moe_small", *on_one_gpu(hw), "steps=10", "seq_len=1024", "batch.micro=8",
        "dtype=bf16", "compile=false", "checkpoint.every=0",
    )  # fmt: skip
    if rc:
        return kernel, Check("moe_small bf16", False, f"exit {rc}: {last}")
    impl = summary.get("expert_impl")
    return kernel, Check("moe_small bf16", impl == "grouped_mm", f"expert_impl={impl}", summary)


def table(checks: list[Check]) -> str:
    rows = [("check", "result", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "planned GiB", "note")]
    for c in checks:
        s = c.summary
        planned = (s.get("prediction") or {}).get("memory_gib")
        rows.append((
            c.name,
            "ok" if c.ok else "FAIL",
            f"{s['median_tokens_per_s']:,.0f}" if "median_tokens_per_s" in s else "-",
            f"{s['median_tflops_per_device']:.0f}" if "median_tflops_per_device" in s else "-",
            f"{s['median_mfu']:.1%}" if "median_mfu" in s else "-",
            f"{s['peak_mem_gib']:.1f}" if s.get("peak_mem_gib") is not None else "-",
            f"{planned:.1f}" if planned is not None else "-",
            c.note,
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def main(argv: list[str]) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device (torch.cuda.is_available() is False): run it on an NVIDIA GPU")
    opts = dict(a.removeprefix("--").split("=", 1) for a in argv if "=" in a)
    name = torch.cuda.get_device_name(0)
    hw = opts.get("hardware", profile_for(name))
    out = Path(opts.get("out", Path("outputs") / "gpu-check" / time.strftime("%Y%m%d-%H%M%S"))).resolve()
    print(f"gpu-check on {name} (hardware={hw}); runs under {out}", flush=True)
    t0 = time.perf_counter()
    checks = [
        throughput(out, hw),
        *fsdp_equality(out, hw),
        build_only(out, hw),
        profiled(out, hw),
        *grouped_gemm(out, hw),
    ]
    print(table(checks))
    print(f"{sum(c.ok for c in checks)}/{len(checks)} checks passed in {time.perf_counter() - t0:.0f} s")
    if not all(c.ok for c in checks):
        sys.exit(1)
