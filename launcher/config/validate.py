"""The config's checks that need no torch, no process and no layout: `validate` runs them all, and the
first that fails raises one LauncherError naming the key and the fix. The layout's own rules (degrees,
batch split, what divides what) are launcher/layout/'s; the expert-parallel lines come from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.config.feature_keys import check_feature_keys, get_key
from launcher.config.hardware import HardwareConfig, load_profile
from launcher.config.mix import mixture_sources
from launcher.config.model import ModelConfig
from launcher.config.precision import FP8_RECIPES
from launcher.config.ranges import check_ranges
from launcher.config.schema import DataConfig, TrainConfig, compile_enabled
from launcher.errors import LauncherError
from launcher.flops import head_dim, kv_heads
from launcher.layout import RECOMPUTE, RESHARD, SCHEDULES, expert_split

CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.norm_position": ("pre", "post"),
    "model.mlp": ("swiglu", "gelu"),
    "model.positions": ("rope", "learned"),
    "model.moe.score": ("sigmoid", "softmax"),
    "model.moe.balance": ("bias", "aux", "none"),
    "data.name": ("stdlib", "tokens", "text", "mix"),
    "data.dtype": ("uint16", "uint32"),
    "pp_schedule": (*SCHEDULES, "auto"),  # auto: the planner's choice
    "recompute": (*RECOMPUTE, "auto"),
    "fsdp.reshard_after_forward": RESHARD,
    "dtype": ("auto", "fp32", "bf16", "fp8"),
    "fp8.recipe": FP8_RECIPES,
    "cpu_allocator": ("auto", "fast", "lean"),
    "metrics.console": ("auto", "rich", "plain", "none"),
    "metrics.wandb.mode": ("offline", "online", "disabled"),
    "hardware.kind": ("cpu", "cuda", "tpu"),
    "checkpoint.on_error": ("continue", "stop"),
    "guard.spike": ("off", "skip", "rollback"),
    "guard.snapshot": ("host", "device"),
    "plan.compare_at": ("devices", "budget"),
}


def check_async_tp(cfg: TrainConfig) -> None:
    """async_tp=true: torch's micro-pipelined TP is an inductor pass over CUDA symmetric memory."""
    if not cfg.async_tp:
        return
    if cfg.hardware.kind != "cuda":
        raise LauncherError(
            f"async_tp=true needs CUDA GPUs (torch's async TP uses CUDA symmetric memory), not "
            f"hardware.kind={cfg.hardware.kind}: set async_tp=false"
        )
    if not compile_enabled(cfg) or not cfg.sequence_parallel:
        raise LauncherError(
            "async_tp=true needs compile=true and sequence_parallel=true (torch fuses the TP collectives "
            "with their matmuls while compiling a sequence-parallel block): set them, or async_tp=false"
        )


def validate(cfg: TrainConfig) -> None:
    """Checks that need no torch, no process and no layout: one LauncherError naming the key and the
    fix. `plan` and `train` both run them first (`planner.run_plan`, `planner.resolve`); the layout's
    own rules (degrees, batch split) are in launcher/layout/."""
    check_ranges(cfg)
    for key, allowed in CHOICES.items():
        if get_key(cfg, key) not in allowed:
            raise LauncherError(f"{key}={get_key(cfg, key)}: choose one of {', '.join(allowed)}")
    if not (isinstance(cfg.compile, bool) or cfg.compile == "auto"):
        raise LauncherError(f"compile={cfg.compile}: choose one of true, false, auto")
    check_async_tp(cfg)
    check_fp8(cfg)
    m = cfg.model
    check_heads(m)
    if cfg.seq_len > m.max_seq_len:
        raise LauncherError(
            f"seq_len={cfg.seq_len} exceeds model.max_seq_len={m.max_seq_len} of model '{m.name}': "
            f"lower seq_len or raise model.max_seq_len"
        )
    if cfg.data.name == "text" and cfg.data.val_path:
        raise LauncherError(
            "data.val_path is a token file for data=tokens: data=text holds out whole documents (data.val_fraction)"
        )
    if cfg.data.name == "mix":
        mixture_sources(cfg.data)  # the sources and their weights; each source's files: data.check_mix
    check_profile(cfg)
    compared_profiles(cfg)
    check_moe(m, cfg.ep if isinstance(cfg.ep, int) and cfg.ep >= 1 else 1)  # a bad ep: the degree's own line
    if cfg.metrics.moe_table and not m.moe.experts:
        raise LauncherError(
            "metrics.moe_table=true shows the layers of a mixture of experts: drop it, or use one (model.moe.experts>0)"
        )
    if any(len(pair) != 2 or pair[0] > pair[1] for pair in cfg.guard.skip_batches):
        raise LauncherError(f"guard.skip_batches={cfg.guard.skip_batches}: give [first, last] pairs, first <= last")
    if cfg.data.name == "stdlib" and m.vocab_size < 256:
        raise LauncherError(f"model.vocab_size={m.vocab_size} is below 256, the byte vocabulary of data=stdlib")
    check_document_mask(cfg)
    check_feature_keys(cfg)  # a feature's keys while it is off
    check_timeouts(cfg)


# the shortest limits a healthy run can meet: a rank's beat is stale after 2 s (train/timeouts.stale_after);
# a collective waits on its slowest peer through a first step or a checkpoint
WATCHDOG_MIN_S, COLLECTIVE_MIN_S = 2.0, 30


def check_timeouts(cfg: TrainConfig) -> None:
    """Limits too short to be met would stop a healthy run as hung."""
    if cfg.watchdog.timeout_s and cfg.watchdog.timeout_s < WATCHDOG_MIN_S:
        raise LauncherError(
            f"watchdog.timeout_s={cfg.watchdog.timeout_s} would stop a healthy run as hung (a beat is only stale "
            f"after {WATCHDOG_MIN_S:g} s): give {WATCHDOG_MIN_S:g} or more, leave it unset (from the predicted step), "
            "or 0 to switch the watchdog off"
        )
    if cfg.nccl_timeout_s is not None and cfg.nccl_timeout_s < COLLECTIVE_MIN_S:
        raise LauncherError(
            f"nccl_timeout_s={cfg.nccl_timeout_s} would fail a healthy run (a collective waits on its slowest peer "
            f"through the first step or a checkpoint): give {COLLECTIVE_MIN_S} or more, or leave it unset"
        )


def check_document_mask(cfg: TrainConfig) -> None:
    """data.document_mask=true: sources whose documents end in a known id (each of a mixture's), and
    the layouts it runs."""
    d = cfg.data
    if not d.document_mask:
        return
    for key, source in [(f"{s.key} ", s.cfg) for s in mixture_sources(d)] if d.name == "mix" else [("", d)]:
        check_document_ends(key, source, cfg.model.vocab_size)
    if cfg.cp not in (1, "auto"):  # auto: the planner searches cp=1 only (planner.request.space)
        raise LauncherError(
            f"cp={cfg.cp} with data.document_mask=true: context parallelism splits sequences before their "
            "document boundaries are known (not supported): set cp=1 or data.document_mask=false"
        )
    if cfg.model.dropout > 0:
        raise LauncherError(
            f"model.dropout={cfg.model.dropout} with data.document_mask=true: the masked kernel "
            "(FlexAttention) has no attention dropout: set model.dropout=0"
        )


def check_document_ends(key: str, d: DataConfig, vocab_size: int) -> None:
    """A source's documents end in a known id: `key` names the source of a mixture ('' otherwise)."""
    if d.name == "stdlib":
        raise LauncherError(
            f"data.document_mask=true with {key}data=stdlib: its files are joined with no end-of-document token: "
            "use data=text, or data=tokens with data.eos_id"
        )
    if d.name == "tokens" and d.eos_id is None:
        raise LauncherError(
            f"data.document_mask=true with {key}data=tokens: set data.eos_id=ID, the id ending each document"
        )
    if d.name == "tokens" and d.eos_id >= vocab_size:
        raise LauncherError(f"{key}data.eos_id={d.eos_id} is beyond model.vocab_size={vocab_size}: fix the id")


def require_fp8_units(hw: HardwareConfig, emulate: bool) -> None:
    """dtype=fp8 runs (and is predicted) only where the profile has float8 units, or under emulation."""
    if hw.peak_tflops_fp8 is None and not emulate:
        raise LauncherError(
            f"dtype=fp8: hardware profile {hw.name} has no FP8 units (peak_tflops_fp8 is null): use dtype=bf16, "
            "an FP8 profile (h100_sxm, h200, b200, gb200_nvl72), or fp8.emulate=true to check the path"
        )


def check_fp8(cfg: TrainConfig) -> None:
    """dtype=fp8: a profile with float8 units (or torchao's emulation), and float8 GEMM shapes (dims
    multiples of 16) for every layer the shape filter converts; smaller layers stay high precision."""
    if cfg.dtype != "fp8":
        return
    fp8 = cfg.fp8
    require_fp8_units(cfg.hardware, fp8.emulate)
    check_fp8_tokens(cfg)
    for name, (n_in, n_out) in block_linears(cfg.model).items():
        if min(n_in, n_out) >= fp8.min_features and (n_in % 16 or n_out % 16):
            raise LauncherError(
                f"fp8.min_features={fp8.min_features} converts {name} ({n_in} -> {n_out} features) and float8 "
                f"matmuls need multiples of 16: raise fp8.min_features above {min(n_in, n_out)} to keep it in "
                "high precision, or resize the model"
            )


def check_fp8_tokens(cfg: TrainConfig) -> None:
    """A micro-batch's tokens on a rank (batch.micro x seq_len / cp) are the inner dimension of every
    float8 weight-gradient matmul, which a GPU takes only in multiples of 16 (emulation takes any: it
    rehearses the GPU's path, so it is held to the same rule). batch.micro=auto may choose 1."""
    per_sequence = cfg.seq_len // (cfg.cp if isinstance(cfg.cp, int) else 1)
    micro = cfg.batch.get("micro")
    tokens = per_sequence * (micro if isinstance(micro, int) else 1)
    if tokens % 16:
        up = -(-per_sequence // 16) * 16 * (cfg.cp if isinstance(cfg.cp, int) else 1)
        raise LauncherError(
            f"dtype=fp8: a micro-batch holds {tokens} tokens a rank (batch.micro={micro} x seq_len={cfg.seq_len}"
            f"{f' / cp={cfg.cp}' if per_sequence != cfg.seq_len else ''}) and float8 weight gradients need a "
            f"multiple of 16: use seq_len={up}, or a batch.micro that makes one"
        )


def block_linears(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of a dense block's linear layers, by name: what dtype=fp8 may convert."""
    q, kv = m.n_heads * head_dim(m), kv_heads(m) * head_dim(m)
    shapes = {"attention.wq": (m.dim, q), "attention.wk": (m.dim, kv), "attention.wv": (m.dim, kv)}
    shapes["attention.wo"] = (q, m.dim)
    if m.moe.experts and not m.moe.first_dense_layers:  # every MLP is a MoE layer: high precision
        return shapes
    shapes |= {"feed_forward.w1": (m.dim, m.ffn_dim), "feed_forward.w2": (m.ffn_dim, m.dim)}
    return shapes | ({"feed_forward.w3": (m.dim, m.ffn_dim)} if m.mlp == "swiglu" else {})


def check_heads(m: ModelConfig) -> None:
    """The attention heads: they split the width evenly, KV heads group them, RoPE rotates pairs."""
    if m.head_dim is None and m.dim % m.n_heads:
        raise LauncherError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}: change either")
    if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        raise LauncherError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if m.positions == "rope" and head_dim(m) % 2:
        raise LauncherError(f"head dim {head_dim(m)} is odd: RoPE needs an even model.head_dim")


def check_profile(cfg: TrainConfig) -> None:
    """profile.*: a window inside the run; a memory snapshot only where a CUDA allocator records it."""
    p = cfg.profile
    if p.start is not None and cfg.steps and p.start > cfg.steps:
        raise LauncherError(f"profile.start={p.start} is after the last step (steps={cfg.steps}): lower profile.start")
    if p.memory and (p.start is None or cfg.hardware.kind != "cuda"):
        raise LauncherError(
            "profile.memory=true dumps a CUDA memory snapshot: set profile.start=N on a cuda hardware profile, "
            "or drop profile.memory"
        )


def check_moe(m: ModelConfig, ep: int) -> None:
    """The model-side MoE rules, and ep against the experts (`layout.expert_split`, the layout's own
    rule and wording); ep against the data-parallel ranks is the layout's alone."""
    moe = m.moe
    if moe.experts and moe.top_k > moe.experts:
        raise LauncherError(f"model.moe.top_k={moe.top_k} exceeds model.moe.experts={moe.experts}: lower top_k")
    problem = expert_split(ep, m)
    if problem:
        raise LauncherError(problem)
    if moe.experts and moe.first_dense_layers >= m.n_layers:
        raise LauncherError(
            f"model.moe.first_dense_layers={moe.first_dense_layers} leaves no MoE layer of "
            f"model.n_layers={m.n_layers}: lower it or set model.moe.experts=0"
        )


def compared_profiles(cfg: TrainConfig) -> list[HardwareConfig]:
    """The profiles `plan.compare` names (the run's own as configured, the others as packaged), checked:
    a token budget to cost, accelerators only, and prices wherever the same budget is asked for."""
    plan = cfg.plan
    if not plan.compare:
        return []
    if plan.tokens is None:
        raise LauncherError("plan.compare costs a token budget on each profile: give plan.tokens=N (e.g. 15e12)")
    own = cfg.hardware
    profiles = [own if name == own.name else load_profile(name, "plan.compare") for name in plan.compare]
    if any(hw.kind == "cpu" for hw in profiles):
        raise LauncherError("plan.compare: the cpu profile is this machine, not one to rent: name accelerator profiles")
    if plan.compare_at == "budget":
        if cfg.hardware.price_per_hour is None:
            raise LauncherError(
                f"plan.compare_at=budget spends what {cfg.hardware.name} costs an hour, and it has no price: "
                "give hardware.price_per_hour=USD, or use plan.compare_at=devices"
            )
        unpriced = [hw.name for hw in profiles if hw.price_per_hour is None]
        if unpriced:
            raise LauncherError(
                f"plan.compare_at=budget rents devices by price, and {unpriced[0]} has none: drop it from "
                "plan.compare, or use plan.compare_at=devices"
            )
    return profiles


def calibrate_value(dirs: list[str]) -> str:
    """plan.calibrate's value as a command line takes it back: DIR, or [DIR,DIR] (a bare a,b is a sweep)."""
    return dirs[0] if len(dirs) == 1 else f"[{','.join(dirs)}]"


def check_calibrate(value: Any) -> list[str]:
    """plan.calibrate's directories (one, or a list): each exists, and some run summary is under them."""
    dirs = [value] if isinstance(value, str) else value
    if not isinstance(dirs, list) or not dirs or not all(isinstance(d, str) and d.strip() for d in dirs):
        raise LauncherError(f"plan.calibrate={value}: give a directory, or a list of them: plan.calibrate=[DIR,DIR]")
    for name in dirs:
        if not Path(name).is_dir():
            raise LauncherError(
                f"plan.calibrate: no directory {name!r}: give run or sweep directories (a run's run_dir, "
                "a multirun's sweep directory)"
            )
    if not any(next(Path(name).rglob("summary.json"), None) for name in dirs):
        raise LauncherError(
            f"plan.calibrate={calibrate_value(dirs)}: no summary.json under it: give the directories of finished "
            "`train` runs (each writes run_dir/summary.json)"
        )
    for summary in (found for name in dirs for found in Path(name).rglob("summary.json")):
        try:
            ok = isinstance(json.loads(summary.read_text()), dict)
        except (OSError, UnicodeDecodeError, ValueError):
            ok = False
        if not ok:
            raise LauncherError(
                f"plan.calibrate: {summary} is not a run's summary (a JSON object): remove it, or leave its folder out"
            )
    return dirs
