"""`doctor`: is this machine ready for a run? The first command on a new cluster.

One line a check, `ok`, `warning` or `fail`: torch and the range this launcher is tested on; CUDA,
cuDNN, NCCL, the GPUs and their driver; which SDPA kernels take the attention call training makes;
a one-block `torch.compile`; a one-rank process group; SLURM; free disk where runs and caches go; the
measured matmul rate against the hardware profile's; the optional extras. Exit 1 only when something
a run needs is missing; a check that breaks is a `fail` line, never a traceback.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path
from typing import Any

from launcher.config.extras import EXTRAS, installed
from launcher.errors import LauncherError

GIB = 2**30
DISK_FAIL_GIB, DISK_WARN_GIB = 1.0, 20.0  # a checkpoint of a small model / of an 8B one (with optimizer: ~100 GB)
PEAK_WARN = 0.8  # a matmul rate below this share of what the profile (or the cached calibration) says


@dataclass(frozen=True)
class Finding:
    status: str  # ok | warning | fail
    name: str
    detail: str


@dataclass(frozen=True)
class Setting:
    """What doctor checks for: the hardware profile a run would use, where it writes, and whether it compiles."""

    hardware: Any  # launcher.config.schema.HardwareConfig
    run_dir: Path
    cache_dir: Path
    compile: bool

    @property
    def cuda(self) -> bool:
        return self.hardware.kind == "cuda"


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def in_range(version: str, spec: str) -> bool:
    """`version` within a requirement's comparisons (`>=2.11,<2.16`)."""
    have = version_tuple(version)
    ops = {">=": have.__ge__, ">": have.__gt__, "<=": have.__le__, "<": have.__lt__, "==": have.__eq__}
    return all(ops[op](version_tuple(v)) for op, v in re.findall(r"(>=|<=|==|>|<)\s*([\d.]+)", spec))


def check_torch() -> Finding:
    import torch

    try:
        spec = next(r for r in requires("launcher") or [] if re.match(r"torch\b", r)).removeprefix("torch")
    except (PackageNotFoundError, StopIteration):
        spec = ""
    line = f"{torch.__version__} on Python {platform.python_version()}; the launcher is tested on torch{spec}"
    return Finding("ok" if in_range(torch.__version__, spec) else "warning", "torch", line)


def check_cuda(s: Setting) -> Iterator[Finding]:
    import torch

    if not torch.cuda.is_available():
        status = "fail" if s.cuda else "ok"
        yield Finding(
            status, "cuda", f"no CUDA device: {'hardware=' + s.hardware.name + ' needs one' if s.cuda else 'CPU runs'}"
        )
        return
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "-"
    yield Finding("ok", "cuda", f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    mem = torch.cuda.get_device_properties(0).total_memory / GIB
    yield Finding("ok", "gpus", f"{len(names)} x {names[0]} ({mem:.0f} GiB), driver {driver_version()}")


def driver_version() -> str:
    if not shutil.which("nvidia-smi"):
        return "unknown (no nvidia-smi)"
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split()
    return out[0] if out else "unknown"


def device(s: Setting) -> Any:
    import torch

    return torch.device("cuda" if s.cuda and torch.cuda.is_available() else "cpu")


def check_sdpa(s: Setting) -> Finding:
    """The attention call training makes (causal, grouped-query heads), in the run's dtype, per SDPA kernel."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = device(s)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.randn(1, 8, 256, 64, device=dev, dtype=dtype)
    kv = torch.randn(1, 2, 256, 64, device=dev, dtype=dtype)
    accepted = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            accepted.append(backend.name.lower())
        except RuntimeError:
            continue
    call = f"{str(dtype).removeprefix('torch.')} causal GQA on {dev.type}"
    if accepted:
        return Finding("ok", "attention", f"{call}: {', '.join(accepted)}")
    return Finding("warning", "attention", f"{call}: only the math kernel (slow, scores in memory)")


def check_compile(s: Setting) -> Finding:
    """A transformer block compiled as training compiles it, one forward and backward: its graphs and
    graph breaks (a break leaves part of every block eager, unfused)."""
    if not s.compile:
        return Finding("ok", "compile", "off for this profile (compile=auto); doctor compile=true checks it")
    import torch

    from launcher.compat.compile_compat import reset_compile_counts
    from launcher.config.model import ModelConfig
    from launcher.model.attention import rope_tables
    from launcher.model.transformer import Block
    from launcher.parallel.compiled import CompileReport

    dev = device(s)
    block = Block(ModelConfig(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256)).to(dev)
    x = torch.randn(2, 64, 128, device=dev, requires_grad=True)
    rope = rope_tables(32, 64, 10000.0, dev)
    reset_compile_counts()
    start = time.perf_counter()
    torch.compile(block)(x, rope).sum().backward()
    report = CompileReport.now(1)
    took = f"one block forward + backward compiled in {time.perf_counter() - start:.0f} s"
    detail = f"{took}: {report.line().removeprefix('compile: ')}"
    return Finding("warning" if report.n_breaks else "ok", "compile", detail)


def check_process_group(s: Setting) -> Finding:
    import torch
    import torch.distributed as dist

    dev = device(s)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        one = torch.ones(1, device=dev)
        dist.all_reduce(one)
        ok = one.item() == 1.0
    finally:
        dist.destroy_process_group()
    return Finding(
        "ok" if ok else "fail", "process group", f"{backend}, one rank: all-reduce {'ok' if ok else 'wrong'}"
    )


def check_slurm() -> Finding:
    sbatch = shutil.which("sbatch")
    if not sbatch:
        return Finding("ok", "slurm", "no sbatch: local runs (hydra/launcher=slurm needs a SLURM login node)")
    version = subprocess.run([sbatch, "--version"], capture_output=True, text=True, timeout=30).stdout.strip() or sbatch
    if not installed("submitit"):
        return Finding("warning", "slurm", f"{version}, but submitit is missing: pip install 'launcher[slurm]'")
    from launcher.launch.slurm import partitions

    try:
        names = partitions()
    except LauncherError as err:  # installed but no controller answers: a submission would fail
        return Finding("warning", "slurm", f"{version}: {err}")
    job = os.environ.get("SLURM_JOB_ID")
    return Finding("ok", "slurm", f"{version}, partitions {', '.join(names)}{f', inside job {job}' if job else ''}")


def check_disk(key: str, path: Path) -> Finding:
    """Free space where `key` points (its nearest existing folder), and whether the launcher may write there."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free / GIB
    where = f"{key}={path}: {free:.0f} GiB free"
    if not os.access(existing, os.W_OK):
        return Finding("fail", key, f"{key}={path}: {existing} is not writable: choose another {key}")
    if free < DISK_FAIL_GIB:
        return Finding("fail", key, f"{where}: too little for one checkpoint")
    return Finding("warning" if free < DISK_WARN_GIB else "ok", key, where)


def check_peak(s: Setting) -> Finding:
    """The matmul rate now against what the planner prices with: the profile's peak x efficiency on a GPU,
    the cached calibration on a CPU."""
    from launcher.hardware import probes

    if device(s).type == "cuda":
        expected = s.hardware.peak_tflops * 1e12 * s.hardware.matmul_efficiency
        source = f"hardware={s.hardware.name}: {s.hardware.peak_tflops:.0f} x {s.hardware.matmul_efficiency}"
        measured = cuda_matmul_flops()
    else:
        threads = os.cpu_count() or 1
        cached = probes.cached_gemm_flops(threads, str(s.cache_dir))
        if cached is None:
            return Finding("ok", "peak", "CPU not calibrated yet: the first run measures it once (~13 s)")
        expected, source = cached, "the cached calibration"
        measured = probes.measure_gemm_flops(threads, seconds=0.3, trials=2)
        if raised := probes.offer_gemm_peak(threads, str(s.cache_dir), measured):  # cached on a busy machine
            return Finding("ok", "peak", raised)
    line = f"{measured / 1e12:.3g} TFLOP/s now, {expected / 1e12:.3g} from {source}"
    if measured >= PEAK_WARN * expected:
        return Finding("ok", "peak", line)
    return Finding("warning", "peak", f"{line}: slower than planned (a busy machine, clocks, or a stale cache)")


def cuda_matmul_flops(n: int = 8192, repeats: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def check_extras() -> Finding:
    missing = sorted({extra for module, extra in EXTRAS.items() if not installed(module)})
    if not missing:
        return Finding("ok", "extras", f"all installed: {', '.join(sorted(set(EXTRAS.values())))}")
    return Finding("warning", "extras", f"missing {', '.join(missing)}: pip install 'launcher[{','.join(missing)}]'")


def findings(s: Setting) -> Iterator[Finding]:
    """Every check in turn; one that raises is its own fail line."""
    checks: list[tuple[str, Callable[[], Any]]] = [
        ("torch", check_torch),
        ("cuda", lambda: check_cuda(s)),
        ("attention", lambda: check_sdpa(s)),
        ("compile", lambda: check_compile(s)),
        ("process group", lambda: check_process_group(s)),
        ("slurm", check_slurm),
        ("run_dir", lambda: check_disk("run_dir", s.run_dir)),
        ("cache_dir", lambda: check_disk("cache_dir", s.cache_dir)),
        ("peak", lambda: check_peak(s)),
        ("extras", check_extras),
    ]
    for name, check in checks:
        try:
            result = check()
            yield from [result] if isinstance(result, Finding) else result
        except Exception as err:  # noqa: BLE001 - doctor reports, it never raises
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            yield Finding("fail", name, f"{type(err).__name__}: {first[:160]}")


def run(s: Setting) -> int:
    print(f"doctor: hardware={s.hardware.name}, run_dir={s.run_dir}, cache_dir={s.cache_dir}", flush=True)
    counts = {"ok": 0, "warning": 0, "fail": 0}
    for f in findings(s):
        counts[f.status] += 1
        print(f"{f.status:<8} {f.name:<14} {f.detail}", flush=True)
    warnings = f"{counts['warning']} warning{'' if counts['warning'] == 1 else 's'}"
    print(f"doctor: {counts['ok']} ok, {warnings}, {counts['fail']} failed", flush=True)
    return 1 if counts["fail"] else 0


def default_hardware() -> str:
    """The profile of this machine's first GPU, else cpu."""
    import torch

    from launcher.hardware.resolve import profile_for_device

    return profile_for_device(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"
