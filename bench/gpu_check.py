"""`make gpu-check` (`python -m bench gpu_check [--hardware=NAME] [--out=DIR] [--deadline=S] [--only=A,B]
[--rehearse]`): the CUDA path on one GPU, through the `train` command a user runs, in one lease.

Checks (each `--only` name, its budget of the deadline, its rows):
- throughput: `1b`, 30 steps of 8 x 2048 tokens, bf16 + compile: tokens/s, TFLOP/s and MFU over the
  steps after a warm-up (compile time stays out), judged against the goal (MFU >= 55% on H100/H200)
  and against the planner's MFU for the same run (within 15%); measured peak memory beside the
  planner's training prediction; then what compile did (`compile` row: graphs, and no graph break);
- fsdp: `125m` with FSDP2 (bf16 MixedPrecisionPolicy, fused AdamW over DTensor shards, one-rank mesh,
  bench/gpu_fsdp.py) against the same steps without FSDP: losses within bf16 tolerance; then a
  checkpoint saved on the GPU and resumed: the same next losses;
- build: `8b` with `steps=0`: every shard allocated for real; its peak (the weights, and the runtime's
  own memory) beside the planner's weights and overhead, like with like;
- profile: `profile.memory=true` writes a CUDA trace and an allocator snapshot;
- moe: the experts' grouped GEMM against the loop (bench/gpu_moe.py), then `moe_small` trains on it;
- fp8: the throughput model under dtype=fp8 against bf16, same steps: tokens/s, losses (bench/gpu_fp8.py).
Every run is a subprocess with a timeout inside its check's budget (sized for cold compile caches) and
the overall `--deadline` (default 540 s); a check that cannot start in time is a `skipped` row. Each
run's whole output, a timed-out one's too, is kept in its folder (`train.out`). Each row is printed and flushed
as it finishes and appended as one JSON line to OUT/results.jsonl, so a lease cut short keeps the rows
done; a failing check never stops the others. `--rehearse` runs the same orchestration on this CPU
with `hardware=cpu` and tiny models, the throughput and fp8 runs compiled by inductor as on a GPU (CI
proves the plumbing). Exit 1 if a row failed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.gpu_fp8 import fp8_vs_bf16
from bench.gpu_runs import Check, Clock, Target, close, failure_line, losses, median, metrics, run_logged, train_cli

LOSS_RTOL = 1e-2  # FSDP's bf16 parameters vs autocast's bf16 casts: the same math, rounded differently
RESUME_RTOL = 1e-3  # the same state on the same device: equal up to kernel non-determinism
GROUPED_RTOL = 2e-2  # bf16 both ways, summed in another order: a few bf16 ulps of the largest entry
MFU_GOAL = 0.55  # H100/H200, 1b bf16 + compile
PLANNER_RTOL = 0.15  # the measured MFU within this of the planner's for the same run
MIN_START_S = 20.0  # a check with less time than this left is skipped, not started
WIDTHS = (26, 10, 9, 8, 7, 9, 11)
HEADER = ("check", "result", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "planned GiB", "note")


def gpu_target(hw: str) -> Target:
    small = ("+model=125m", "steps=10", "seq_len=1024", "batch.micro=8", "compile=false", "optim.warmup_steps=2")
    return Target(
        hardware=(f"hardware={hw}", "hardware.devices_per_node=1"),  # a GPU profile's world is its whole node
        cuda=True,
        big=("+model=1b", "steps=30", "seq_len=2048", "batch.micro=8", "compile=true", "dtype=bf16"),
        warmup=5,
        small=small,
        build=("+model=8b", "force=true"),  # one GPU cannot train 8b, it can hold it
        moe=("+model=moe_small", "steps=10", "seq_len=1024", "batch.micro=8", "dtype=bf16", "compile=false"),
        experts={"experts": 128, "dim": 2048, "hidden": 768, "rows": 4096 * 8},  # Qwen3-30B-A3B, one layer
        goal=MFU_GOAL,
        fp8=("dtype=fp8",),
    )


def rehearsal() -> Target:
    tiny = ("+model=tiny", "steps=10", "seq_len=64", "batch.micro=4", "optim.warmup_steps=2", "data.max_bytes=200000")
    return Target(
        hardware=("hardware=cpu", "threads=1"),
        cuda=False,
        big=(*tiny[:1], "steps=8", *tiny[2:], "compile=true"),  # inductor's CPU backend: the compiled path
        warmup=2,
        small=tiny,
        build=("+model=small",),
        moe=("+model=moe_tiny", *tiny[1:]),
        experts={"experts": 8, "dim": 64, "hidden": 32, "rows": 300},
        goal=None,
        fp8=("dtype=fp8", "fp8.emulate=true", "fp8.min_features=16"),  # the CPU has no float8 units
    )


def throughput(out: Path, t: Target, clock: Clock) -> list[Check]:
    run = out / "throughput"
    rc, summary, why = train_cli(run, t, clock, *t.big, "checkpoint.every=0")
    if rc:
        return [Check("throughput", "FAIL", f"exit {rc}: {why}")]
    timed = [row for row in metrics(run) if row["step"] > t.warmup]
    mfu = median([r["mfu"] for r in timed])
    planned = (summary.get("prediction") or {}).get("mfu")
    figures = {
        "tokens_per_s": median([r["tokens_per_s"] for r in timed]),
        "tflops": median([r["tflops_per_device"] for r in timed]),
        "mfu": mfu,
        "peak_gib": summary.get("peak_mem_gib"),
        "planned_gib": (summary.get("prediction") or {}).get("memory_gib"),
    }
    note = f"steps {t.warmup + 1}-{timed[-1]['step']}, {summary.get('precision')}"
    result = "ok"
    if planned:  # the planner's own figure for this run: a model that is off by more is a finding too
        off = mfu / planned - 1
        note += f"; planner {planned:.1%} ({off:+.0%})"
        if t.goal is not None and abs(off) > PLANNER_RTOL:
            result = "off plan"
    if t.goal is None:
        note += "; the MFU goal and the planner's are judged on GPUs"
    else:
        note += f"; goal {t.goal:.0%} {'met' if mfu >= t.goal else 'below'}"
        result = result if mfu >= t.goal else "below goal"
    return [Check("throughput", result, note, figures), compiled(summary)]


def compiled(summary: dict[str, Any]) -> Check:
    """What torch.compile did in the throughput run: one graph per block kind and no graph break."""
    from launcher.parallel.compiled import CompileReport

    c = summary.get("compiled")
    if not c:
        return Check("compile", "FAIL", f"no compiled blocks (compile={summary.get('compile')})")
    line = CompileReport(c["units"], c["graphs"], c["break_reasons"]).line().removeprefix("compile: ")
    return Check("compile", "FAIL" if c["graph_breaks"] else "ok", line)


def fsdp_and_resume(out: Path, t: Target, clock: Clock) -> list[Check]:
    """`small` without FSDP (checkpoints at 5 and 10), with FSDP on a one-rank mesh, and resumed from step 5."""
    ref = out / "reference"
    rc, _, why = train_cli(ref, t, clock, *t.small, "checkpoint.every=5")
    if rc:
        return [Check("fsdp: reference run", "FAIL", f"exit {rc}: {why}")]
    fsdp_dir = out / "fsdp"
    worker = [sys.executable, "-m", "bench.gpu_fsdp", str(fsdp_dir), *t.small, *t.hardware]
    rc, why = run_logged(worker, fsdp_dir / "worker.out", clock)
    if rc:
        fsdp = Check("fsdp: FSDP2 = no FSDP", "FAIL", f"exit {rc}: {why}")
    else:
        result = json.loads((fsdp_dir / "result.json").read_text())
        ok, worst = close({int(k): v for k, v in result["losses"].items()}, losses(ref), LOSS_RTOL)
        note = f"losses within {worst:.1e} (tolerance {LOSS_RTOL:.0e}), {result['precision']}, {result['optimizer']}"
        fsdp = Check("fsdp: FSDP2 = no FSDP", "ok" if ok else "FAIL", note, {"peak_gib": result["peak_mem_gib"]})
    resumed = out / "resumed"
    checkpoint = ref / "checkpoints" / "step_00000005"
    rc, _, why = train_cli(resumed, t, clock, *t.small, f"resume={checkpoint}", "checkpoint.every=0")
    if rc:
        return [fsdp, Check("fsdp: save + resume", "FAIL", f"exit {rc}: {why}")]
    ok, worst = close(losses(resumed), losses(ref), RESUME_RTOL)
    note = f"steps 6-10 after resuming step 5: within {worst:.1e} (tolerance {RESUME_RTOL:.0e})"
    return [fsdp, Check("fsdp: save + resume", "ok" if ok else "FAIL", note)]


def build_only(out: Path, t: Target, clock: Clock) -> list[Check]:
    """steps=0: the real build of every shard; its peak is the weights, compared with the planned weights."""
    rc, summary, why = train_cli(out / "build", t, clock, *t.build, "steps=0")
    if rc:
        return [Check("build: steps=0", "FAIL", f"exit {rc}: {why}")]
    planned = (summary.get("prediction") or {}).get("memory") or {}
    weights = planned["params"] + planned["overhead"] if planned else None
    figures = {"peak_gib": summary.get("peak_mem_gib"), "planned_gib": weights}
    return [Check("build: steps=0", "ok", f"{t.build[0]}: the weights and the runtime's overhead, both sides", figures)]


def profiled(out: Path, t: Target, clock: Clock) -> list[Check]:
    """The Chrome trace (with CUDA kernels on a GPU) and, on CUDA, the allocator snapshot."""
    run = out / "profile"
    memory = f"profile.memory={str(t.cuda).lower()}"
    rc, summary, why = train_cli(run, t, clock, *t.small, "steps=3", "profile.start=2", memory, "checkpoint.every=0")
    if rc:
        return [Check("profile", "FAIL", f"exit {rc}: {why}")]
    files = sorted(p.name for p in (run / "profile").iterdir())
    want = ["rank0.memory.pickle", "rank0.trace.json"] if t.cuda else ["rank0.trace.json"]
    top = summary.get("profile", [""])[0]
    ok = files == want and ("CUDA" in top or not t.cuda)
    return [Check("profile", "ok" if ok else "FAIL", f"{files}; {top[:80]}")]


def moe(out: Path, t: Target, clock: Clock) -> list[Check]:
    """The grouped GEMM against the loop over experts, then a MoE model trains on the grouped path (CUDA)."""
    kernel_dir = out / "moe_kernel"
    shapes = [f"--{k}={v}" for k, v in t.experts.items()]
    rc, why = run_logged([sys.executable, "-m", "bench.gpu_moe", str(kernel_dir), *shapes], kernel_dir / "out", clock)
    if rc:
        kernel = Check("moe: grouped GEMM = loop", "FAIL", f"exit {rc}: {why}")
    else:
        r = json.loads((kernel_dir / "result.json").read_text())
        worst = max(r["max_rel_diff"])
        speed = f"fwd+bwd loop {r['loop_ms']:.2f} ms, grouped {r['grouped_ms']:.2f} ms"
        note = f"{r['selected']}; within {worst:.1e} (tolerance {GROUPED_RTOL:.0e}); {speed}"
        ok = worst <= GROUPED_RTOL and (r["selected"] == "grouped_mm" or not t.cuda)
        kernel = Check("moe: grouped GEMM = loop", "ok" if ok else "FAIL", note)
    rc, summary, why = train_cli(out / "moe_model", t, clock, *t.moe, "checkpoint.every=0")
    if rc:
        return [kernel, Check("moe: model trains", "FAIL", f"exit {rc}: {why}")]
    impl = summary.get("expert_impl")
    ok = impl == "grouped_mm" or not t.cuda
    return [kernel, Check("moe: model trains", "ok" if ok else "FAIL", f"expert_impl={impl}")]


# name (for --only), budget in seconds (of the default deadline's 540), check
CHECKS: list[tuple[str, float, Callable[[Path, Target, Clock], list[Check]]]] = [
    ("throughput", 240, throughput),  # a cold compile of 1b: 90-160 s before the first step
    ("fsdp", 110, fsdp_and_resume),
    ("build", 60, build_only),
    ("profile", 45, profiled),
    ("moe", 55, moe),
    ("fp8", 180, fp8_vs_bf16),  # the fp8 run (compiled anew); its bf16 side the throughput run's steps
]


def row(c: Check) -> str:
    f = c.figures

    def num(key: str, fmt: str) -> str:
        return "-" if f.get(key) is None else format(f[key], fmt)

    cells = (c.name, c.result, num("tokens_per_s", ",.0f"), num("tflops", ".3g"), num("mfu", ".1%"))
    cells += (num("peak_gib", ".1f"), num("planned_gib", ".1f"))
    return "  ".join(v.ljust(w) for v, w in zip(cells, WIDTHS)) + "  " + c.note


def run_checks(out: Path, target: Target, checks: list, deadline_s: float) -> list[Check]:
    """Every check in turn inside the deadline; each row printed and appended to results.jsonl as it ends."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + deadline_s
    print("  ".join(v.ljust(w) for v, w in zip(HEADER, WIDTHS)) + "  " + HEADER[-1], flush=True)
    done: list[Check] = []
    for name, budget, check in checks:
        left = deadline - time.monotonic()
        if left < MIN_START_S:
            rows = [Check(name, "skipped", f"--deadline: {max(left, 0):.0f} s left, {budget:.0f} s budgeted")]
        else:
            try:
                rows = check(out, target, Clock(deadline, budget))
            except Exception as err:  # noqa: BLE001 - one check's failure never stops the others
                rows = [Check(name, "FAIL", f"{type(err).__name__}: {failure_line(str(err))}")]
        for c in rows:
            print(row(c), flush=True)
            with (out / "results.jsonl").open("a") as f:
                f.write(json.dumps(asdict(c)) + "\n")
        done += rows
    return done


def main(argv: list[str]) -> None:
    opts = dict(a.removeprefix("--").partition("=")[::2] for a in argv)
    rehearse = "rehearse" in opts
    if rehearse:
        name, target = "this CPU (rehearsal: hardware=cpu, tiny models)", rehearsal()
    else:
        import torch

        from launcher.hardware.resolve import profile_for_device

        if not torch.cuda.is_available():
            raise SystemExit("gpu-check: no CUDA device (torch.cuda.is_available() is False): run it on an NVIDIA GPU")
        name = torch.cuda.get_device_name(0)
        target = gpu_target(opts.get("hardware") or profile_for_device(name))
    only = [n for n in opts.get("only", "").split(",") if n]
    unknown = sorted(set(only) - {n for n, _, _ in CHECKS})
    if unknown:
        raise SystemExit(f"gpu-check: unknown check {unknown[0]!r}: choose from {', '.join(n for n, _, _ in CHECKS)}")
    out = Path(opts.get("out") or Path("outputs") / "gpu-check" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    deadline = float(opts.get("deadline") or 540)
    print(f"gpu-check on {name} ({' '.join(target.hardware)}); deadline {deadline:.0f} s; under {out}", flush=True)
    start = time.monotonic()
    rows = run_checks(out, target, [c for c in CHECKS if not only or c[0] in only], deadline)
    counts = {r: sum(c.result == r for c in rows) for r in ("ok", "below goal", "off plan", "FAIL", "skipped")}
    summary = ", ".join(f"{n} {r}" for r, n in counts.items() if n)
    print(f"gpu-check: {summary} in {time.monotonic() - start:.0f} s (rows in {out / 'results.jsonl'})", flush=True)
    if counts["FAIL"]:
        sys.exit(1)
