"""`python -m bench published_runs`: the planner against published training runs, the layout each
run trained with and the throughput it reported (tests/unit/test_planner_published.py holds it to a
median error of 10% and a worst of 25%, and refuses none of the layouts). What a paper does not
give (micro-batch size, virtual stages, for some the recompute policy) is left `auto` for the
planner to choose; what it gives is fixed.

Throughput is compared the way each source counts it: Megatron-style "TFLOP/s per GPU" counts the
recomputed forward (hardware FLOPs, `hfu`), MFU does not (`mfu`). Which runs fit the constants is
said in docs/planner.md (`FITTED` here: the sources the efficiency constants were fitted on).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from launcher import planner
from launcher.config.schema import CONF_DIR, TrainConfig
from launcher.config.validate import validate
from launcher.errors import LauncherError
from launcher.planner import Prediction

CONF = Path(CONF_DIR)

# Megatron's GPT: 51200 vocabulary (50257 padded), learned positions, GELU, LayerNorm, biases, dropout;
# the input embedding is shared with the output layer, across pipeline stages as a copy on the last
# stage whose gradient is all-reduced with the first's once per step (launcher/parallel/tied.py).
GPT = dict(vocab_size=51200, norm="layernorm", mlp="gelu", positions="learned", bias=True, dropout=0.1, n_kv_heads=None)


def gpt(name: str, dim: int, layers: int, heads: int, seq: int, vocab: int = 51200) -> dict[str, Any]:
    return dict(
        GPT, name=name, dim=dim, n_layers=layers, n_heads=heads, ffn_dim=4 * dim, max_seq_len=seq,
        vocab_size=vocab, tied_embeddings=True,
    )  # fmt: skip


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: Any  # a launcher/conf/model name, or the fields of a ModelConfig
    hardware: str
    gpus: int
    tp: int
    pp: int
    seq: int
    global_batch: int  # sequences
    published: float  # TFLOP/s per GPU, or tokens/s per GPU (metric "tokens")
    metric: str = "hfu"  # hfu: recompute counted (Megatron's TFLOP/s); mfu: model FLOPs only; tokens
    recompute: str = "auto"
    micro: int | str = "auto"
    schedule: str = "auto"
    dp_shard: int | str = 1  # 1: DDP; the dp degree: FSDP / ZeRO (optimizer and gradients sharded)
    fused_attention: bool = True  # False: the score matrix materialized (Megatron before FlashAttention)
    compiled: bool = True  # pointwise ops fused (torch.compile, Megatron's fused kernels, XLA); False: eager
    dtype: str = "auto"  # fp8: torchao's float8 linears, `recipe`
    recipe: str = "tensorwise"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


SHOEYBI = "Shoeybi et al. 2019, Megatron-LM (V100, DGX-2H)"
NARAYANAN = "Narayanan et al. 2021, table 1 (A100 80GB, full recompute)"
KORTHIKANTI = "Korthikanti et al. 2022, tables 3 and 5 (A100 80GB, sequence parallel, selective recompute)"
LLAMA3 = "Llama 3 herd of models 2024, table 4 (H100 80GB, 405B, 8K sequences)"
BLOOM = "BigScience BLOOM 2022 (A100 80GB, Megatron-DeepSpeed, ZeRO-1, full recompute)"
MPT = "MosaicML llm-foundry MPT benchmarks (scripts/train/benchmarking/README.md: FSDP FULL_SHARD, bf16)"
ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (H100 96GB at 500 W, compile)"
TORCHTITAN = (
    "torchtitan docs/performance.md, tables 1 and 3 (2025-01, torch 2024-12-23; H100 96GB HBM2e at 500 W, "
    "FSDP2, local batch 2 x 8192, selective op recompute)"
)

# MPT (llm-foundry yamls): GPT shape without biases, LayerNorm, GELU 4x, tied embeddings, 50368 vocabulary;
# the benchmark runs use learned positions (their parameter counts grow with the sequence length)
MPT_SHAPES = {  # name: (d_model, n_heads, n_layers)
    "125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
    "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80),
}  # fmt: skip


def _mpt(
    size: str,
    hw: str,
    gpus: int,
    seq: int,
    micro: int,
    accum: int,
    recompute: bool,
    tokens_per_gpu: float,
) -> Run:
    dim, heads, layers = MPT_SHAPES[size]
    model = dict(gpt(f"mpt-{size}", dim, layers, heads, seq, vocab=50368), bias=False, dropout=0.0)
    return Run(
        f"MPT {size} {gpus}x{hw} seq {seq}", MPT, model, hw, gpus, 1, 1, seq, micro * accum * gpus, tokens_per_gpu,
        metric="tokens", recompute="full" if recompute else "none", micro=micro, dp_shard="dp", compiled=False,
    )  # fmt: skip


def _torchtitan(gpus: int, compiled: bool, tokens_per_gpu: float, dtype: str = "auto") -> Run:
    """Llama 3.1 8B, FSDP over every GPU, with and without torch.compile (per block; the loss eager)."""
    name = f"Llama 3.1 8B {gpus}xH100 FSDP {'compiled' if compiled else 'eager'}" + (" fp8" if dtype == "fp8" else "")
    return Run(
        name, TORCHTITAN, "8b", "h100_sxm", gpus, 1, 1, 8192, 2 * gpus, tokens_per_gpu, metric="tokens",
        recompute="selective", micro=2, dp_shard="dp", compiled=compiled, dtype=dtype,
    )  # fmt: skip


def _async_tp(size: str, gpus: int, local: int, recipe: str | None, async_tp: bool, tokens_per_gpu: float) -> Run:
    """Llama 3.1 8B (FSDP 8 x TP 8, per-op SAC) and 70B (FSDP 32 x TP 8, full AC), compiled, bf16 or float8."""
    name = f"Llama 3.1 {size.upper()} {gpus}xH100 tp=8 {recipe or 'bf16'}{' async TP' if async_tp else ''}"
    return Run(
        name, ASYNC_TP, size, "h100_sxm", gpus, 8, 1, 8192, local * gpus // 8, tokens_per_gpu, metric="tokens",
        recompute="full" if size == "70b" else "selective", micro=local, dp_shard="dp",
        dtype="fp8" if recipe else "auto", recipe=recipe or "tensorwise",
        extra={"sequence_parallel": True, "async_tp": async_tp},
    )  # fmt: skip


def _narayanan(params: str, heads: int, dim: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tf: float):
    return Run(
        f"GPT {params} {gpus}xA100 tp={tp} pp={pp}", NARAYANAN, gpt(params, dim, layers, heads, 2048), "a100",
        gpus, tp, pp, 2048, batch, tf, recompute="full", schedule="1f1b" if pp > 1 else "auto", fused_attention=False,
    )  # fmt: skip


def _korthikanti(params: str, heads: int, dim: int, layers: int, pp: int, gpus: int, batch: int, mfu: float):
    # unfused attention, whose score matrix their selective recompute drops: the planner's `selective`
    return Run(
        f"GPT {params} {gpus}xA100 tp=8 pp={pp} sp", KORTHIKANTI, gpt(params, dim, layers, heads, 2048), "a100",
        gpus, 8, pp, 2048, batch, mfu * 312.0, metric="mfu", recompute="selective", micro=1,
        schedule="1f1b" if pp > 1 else "auto", fused_attention=False, extra={"sequence_parallel": True},
    )  # fmt: skip


RUNS: tuple[Run, ...] = (
    Run("GPT 1.2B 1xV100", SHOEYBI, gpt("1.2b", 1536, 40, 16, 1024), "v100_dgx2", 1, 1, 1, 1024, 8, 39.0,
        recompute="full", micro=8, fused_attention=False),
    Run("GPT 8.3B 512xV100 tp=8", SHOEYBI, "gpt2-8.3b", "v100_dgx2", 512, 8, 1, 1024, 512, 15.1e3 / 512,
        recompute="full", micro=8, fused_attention=False),
    _narayanan("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
    _narayanan("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
    _narayanan("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142),
    _narayanan("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _narayanan("39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _narayanan("76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _narayanan("145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _narayanan("310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _narayanan("529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _narayanan("1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    _korthikanti("22b", 64, 6144, 48, 1, 8, 4, 0.415),
    _korthikanti("175b", 96, 12288, 96, 8, 64, 64, 0.514),
    _korthikanti("530b", 128, 20480, 105, 35, 280, 280, 0.560),
    _korthikanti("1t", 160, 25600, 128, 64, 512, 512, 0.563),
    Run("Llama 3 405B 8192xH100 tp=8 pp=16", LLAMA3, "405b", "h100_sxm", 8192, 8, 16, 8192, 2048, 430.0,
        metric="mfu", dp_shard="dp", micro=1, extra={"sequence_parallel": True}),
    Run("Llama 3 405B 16384xH100 tp=8 pp=16", LLAMA3, "405b", "h100_sxm", 16384, 8, 16, 8192, 2048, 400.0,
        metric="mfu", dp_shard="dp", micro=1, extra={"sequence_parallel": True}),
    Run("BLOOM 176B 384xA100 tp=4 pp=12", BLOOM,
        dict(gpt("176b", 14336, 70, 112, 2048, vocab=250880), positions="rope", dropout=0.0), "a100",
        384, 4, 12, 2048, 2048, 150.0, recompute="full", micro=2, schedule="1f1b", dp_shard="dp",
        fused_attention=False),
    _mpt("760m", "h100_sxm", 8, 2048, 24, 2, False, 63147),
    _mpt("1b", "h100_sxm", 8, 2048, 14, 1, False, 45455),
    _mpt("3b", "h100_sxm", 16, 2048, 10, 3, False, 24142),
    _mpt("7b", "h100_sxm", 8, 2048, 6, 1, False, 10643),
    _mpt("13b", "h100_sxm", 8, 2048, 2, 1, False, 4792),
    _mpt("30b", "h100_sxm", 8, 2048, 3, 21, True, 2002),
    _mpt("70b", "h100_sxm", 64, 2048, 8, 4, True, 1039),
    _mpt("125m", "a100", 8, 2048, 32, 2, False, 141737),
    _mpt("350m", "a100", 8, 2048, 32, 2, False, 58782),
    _mpt("760m", "a100", 8, 2048, 24, 2, False, 32434),
    _mpt("1b", "a100", 8, 2048, 14, 4, False, 20513),
    _mpt("3b", "a100", 8, 2048, 10, 2, False, 10811),
    _mpt("7b", "a100", 8, 2048, 6, 2, False, 4641),
    _mpt("13b", "a100", 8, 2048, 2, 3, False, 2262),
    _mpt("30b", "a100", 8, 2048, 3, 21, True, 916),
    _mpt("70b", "a100", 64, 2048, 8, 4, True, 410),
    _torchtitan(8, False, 5762), _torchtitan(8, True, 6667),
    _torchtitan(128, False, 5605), _torchtitan(128, True, 6514),
)  # fmt: skip

# FP8 (torchao float8 linears): the 8B FSDP run fits hardware.fp8_matmul_efficiency (FP8_FITTED); the rest,
# with their bf16 twins, judge the fp8 term (tests/unit/test_planner_published.py, docs/planner.md)
FP8_RUNS: tuple[Run, ...] = (
    _torchtitan(8, True, 8532, "fp8"),
    *(_async_tp("70b", 256, 16, r, a, tps) for r, a, tps in (
        (None, False, 597.3), (None, True, 652.4), ("tensorwise", False, 809.8), ("tensorwise", True, 942.4),
        ("rowwise", False, 599.6), ("rowwise", True, 624.8))),
    *(_async_tp("8b", 64, 12, r, a, tps) for r, a, tps in (
        (None, False, 4378), (None, True, 4809.4), ("tensorwise", False, 5078.1), ("tensorwise", True, 5570.1),
        ("rowwise", False, 3708.5), ("rowwise", True, 3914.9))),
)  # fmt: skip
FP8_FITTED = ("Llama 3.1 8B 8xH100 FSDP compiled fp8", "Llama 3.1 70B 256xH100 tp=8 rowwise")


def make_cfg(model: Any = "small", hardware: str = "h100_sxm", **overrides: Any) -> TrainConfig:
    """A TrainConfig as `plan`/`train` compose it: schema defaults + model + hardware YAML + overrides."""
    m = OmegaConf.create(model) if isinstance(model, dict) else OmegaConf.load(CONF / "model" / f"{model}.yaml")
    hw = OmegaConf.load(CONF / "hardware" / f"{hardware}.yaml")
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), {"model": m, "hardware": hw}, overrides)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def config(run: Run) -> TrainConfig:
    """The TrainConfig of `run` as `plan`/`train` would compose it: its degrees, batch and policies fixed,
    what the source does not give `auto`."""
    shard = run.dp if run.dp_shard == "dp" else run.dp_shard
    per_node = {"v100_dgx2": 16}.get(run.hardware, 8)
    keys = dict(
        tp=run.tp, pp=run.pp, dp=run.dp, dp_shard=shard, dp_replicate=run.dp // shard, seq_len=run.seq,
        batch={"micro": run.micro, "global": run.global_batch}, recompute=run.recompute, pp_schedule=run.schedule,
        nodes=max(1, run.gpus // per_node), compile=run.compiled, dtype=run.dtype,
    )  # fmt: skip
    fp8 = {"fp8": {"recipe": run.recipe}} if run.dtype == "fp8" else {}
    return make_cfg(run.model, run.hardware, **keys, **run.extra, **fp8)


def achieved(run: Run, cfg: Any, prediction: Any) -> float:
    """The predicted throughput in the unit `run.published` is in."""
    if run.metric == "tokens":
        return prediction.tokens_per_s / run.gpus
    utilisation = prediction.hfu if run.metric == "hfu" else prediction.mfu
    return utilisation * cfg.hardware.peak_tflops


def predict(run: Run) -> tuple[float, Prediction]:
    """(predicted / published - 1, the prediction) for the run's layout, with the run's attention (fused
    or not): the planner's search over what the source leaves `auto`, as `plan` runs it; LauncherError
    if refused."""
    cfg = config(run)
    validate(cfg)
    best = planner.plan(cfg, run.gpus, fused_attention=run.fused_attention)[1].ranked[0]
    return achieved(run, cfg, best) / run.published - 1, best


def short(source: str) -> str:
    return source.split(" (")[0].split(",")[0]


def main(argv: list[str]) -> None:
    table = Table(title="The planner against published runs: predicted / published throughput")
    for col in ("run", "source", "published", "predicted layout", "error"):
        table.add_column(col, justify="left" if col in ("run", "source", "predicted layout") else "right")
    errors = []
    for run in RUNS:
        unit = "tok/s/GPU" if run.metric == "tokens" else f"TFLOP/s ({run.metric.upper()})"
        try:
            err, pred = predict(run)
        except LauncherError as refused:
            table.add_row(run.name, short(run.source), f"{run.published:.0f} {unit}", str(refused), "refused")
            continue
        errors.append(abs(err))
        lay = pred.layout
        chosen = f"micro {lay.micro} x {lay.microbatches}, {lay.recompute}" + (
            f", {lay.schedule}" if lay.pp > 1 else ""
        )
        table.add_row(run.name, run.source.split(",")[0], f"{run.published:.0f} {unit}", chosen, f"{err:+.1%}")
    Console(width=200).print(table)
    median, worst = statistics.median(errors), max(errors)
    print(f"{len(errors)} of {len(RUNS)} runs planned: median |error| {median:.1%}, max {worst:.1%}")
    fp8_table()


def fp8_table() -> None:
    """FP8_RUNS and their bf16 twins: each run's error, and the fp8 / bf16 speed-up predicted and published."""
    table = Table(title="FP8 runs (torchao float8): predicted / published tokens/s per GPU, and fp8 over bf16")
    for col in ("run", "published", "error", "speed-up", "published speed-up", "fitted"):
        table.add_column(col, justify="left" if col == "run" else "right")
    runs = {run.name: run for run in RUNS + FP8_RUNS}
    for run in FP8_RUNS:
        err, pred = predict(run)
        twin = runs.get(run.name.replace(f" {run.recipe}", " bf16") if " tp=8 " in run.name else run.name[:-4])
        ratio = published = "-"
        if run.dtype == "fp8" and twin is not None:
            ratio = f"{pred.tokens_per_s / predict(twin)[1].tokens_per_s:.3f}"
            published = f"{run.published / twin.published:.3f}"
        fitted = "yes" if run.name in FP8_FITTED else "-"
        table.add_row(run.name, f"{run.published:.0f}", f"{err:+.1%}", ratio, published, fitted)
    Console(width=200).print(table)
