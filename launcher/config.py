"""The typed configuration schema: every key, its type and its default, in one place.

Registered in Hydra's ConfigStore as ``base_train`` / ``base_plan``; the YAML files under conf/ only
override. This module must not import torch: `plan` composes the same schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore


class LauncherError(Exception):
    """Bad input. Its message is one line naming the key and the fix; the CLI prints it, exit 2."""


@dataclass
class ModelConfig:
    """Architecture. Defaults are the CPU-sized `small` model (byte-level vocabulary)."""

    name: str = "small"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: as many as n_heads (no GQA)
    ffn_dim: int = 688  # hidden width of the MLP (per gate for SwiGLU)
    vocab_size: int = 256
    max_seq_len: int = 1024
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    norm_position: str = "pre"  # pre | post
    mlp: str = "swiglu"  # swiglu | gelu
    positions: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    tied_embeddings: bool = False
    bias: bool = False  # biases in linear layers (GPT-2 style)
    dropout: float = 0.0
    init_std: float = 0.02


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | tokens
    path: str | None = None  # flat token file (data=tokens)
    dtype: str = "uint16"  # uint16 | uint32 for data=tokens
    val_path: str | None = None  # separate validation token file; None: hold out val_fraction
    val_fraction: float = 0.02
    max_bytes: int = 16_000_000  # stdlib corpus size cap (bytes of source)
    cache_dir: str = "${cache_dir}"  # the tokenized corpus


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


def default_batch() -> dict[str, Any]:
    """`batch.micro`: sequences per micro-batch per data-parallel rank. `batch.global`: sequences
    per optimizer step over all ranks (None: micro x dp, no accumulation). A dict, not a dataclass,
    because `global` is a Python keyword; `validate` checks the types."""
    return {"micro": 8, "global": None}


@dataclass
class EvalConfig:
    every: int = 50  # steps between validation passes; 0 disables
    batches: int = 4


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "launcher"
    entity: str | None = None
    name: str | None = None


@dataclass
class MetricsConfig:
    log_every: int = 1
    console: str = "auto"  # auto (rich panel on a terminal, lines otherwise) | rich | plain | none
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    every: int = 100  # steps between checkpoints (and one at the end); 0 disables
    keep: int = 2  # complete checkpoints kept; older ones are deleted once a newer one is complete
    dir: str | None = None  # None: <run_dir>/checkpoints
    async_save: bool = False  # write in the background while training continues


@dataclass
class LinkConfig:
    """One level of the interconnect: devices that share it, bandwidth per device, latency."""

    name: str = "link"
    size: int = 1  # devices inside one domain of this level
    bandwidth_gbs: float | None = None  # GB/s per device, one direction; None: calibrate (cpu)
    latency_us: float | None = 1.0  # per hop; None: calibrate (cpu)
    # GB/s per device of these two collectives where the backend does not reach the ring algorithm's
    # (gloo's reduce-scatter all-reduces the whole buffer); None: bandwidth_gbs (cpu: calibrated)
    all_gather_gbs: float | None = None
    reduce_scatter_gbs: float | None = None


@dataclass
class HardwareConfig:
    name: str = "cpu"
    kind: str = "cpu"  # cpu | cuda | tpu (tpu: planner only)
    peak_tflops: float | None = None  # dense bf16 (fp32 on cpu); None: calibrate (cpu)
    memory_gib: float = 16.0
    devices_per_node: int = 1
    matmul_efficiency: float = 1.0  # achievable share of peak for large matmuls (planner)
    # host time per tensor-parallel block and microbatch that no device work hides: DTensor dispatch
    # on a CPU, where the host is the device; 0 on accelerators (launches run ahead). None: calibrate
    host_overhead_us: float | None = 0.0
    links: list[LinkConfig] = field(default_factory=list)


@dataclass
class PlanConfig:
    top: int = 10
    format: str = "table"  # table | json
    # plan app: also choose sequence_parallel (on when tp > 1) and virtual_stages (interleaved) instead
    # of taking the top-level values; `train` (best_layout) only fills keys set to auto.
    explore: bool = False


@dataclass
class SweepConfig:
    """The layout sweeper (`-m hydra/sweeper=layouts`): run the planner's best `top` layouts."""

    top: int = 4
    world: int | None = None  # devices to plan for; None: nodes x devices per node (cpu: max_local_workers)


@dataclass
class SlurmConfig:
    """SLURM: the submitit launcher (`-m hydra/launcher=slurm`) reads these; `emit` writes an sbatch script."""

    emit: bool = False  # write an sbatch script that runs this resolved config, print its path, submit nothing
    dry_run: bool = False  # print what would be submitted, submit nothing
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    time_min: int = 60  # time limit (minutes)
    tasks_per_node: int | None = None  # None: from the layout (cpu) or hardware.devices_per_node (cuda)
    cpus_per_task: int | None = None  # None: threads if set, else 1 (cuda: 8)
    signal_delay_s: int = 90  # SIGUSR1 this long before the time limit: checkpoint, then requeue
    max_requeues: int = 3  # requeues after a time limit (preemptions always requeue)
    script: str | None = None  # slurm.emit: where to write it; None: <run_dir>/job.sbatch


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: dict[str, Any] = field(default_factory=default_batch)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    steps: int = 200
    seq_len: int = 256
    seed: int = 1234
    run_dir: str | None = None  # None: Hydra's output directory
    cache_dir: str = "${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/launcher"  # corpus, CPU calibration
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | never | PATH
    max_restarts: int = 0  # local workers: restart the group this often after a failure

    # layout: degrees are ints or "auto"
    nodes: int = 1
    tp: Any = 1
    pp: Any = 1
    dp: Any = "auto"  # whatever ranks remain
    dp_shard: Any = "auto"  # FSDP degree inside dp; auto: all of dp (1 = plain DDP)
    dp_replicate: Any = "auto"  # DDP degree inside dp (HSDP when both > 1)
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    microbatches: int | None = None  # pipeline microbatches; None: 2 x pp
    virtual_stages: int = 1
    recompute: str = "none"  # none | selective | full

    compile: bool = False
    dtype: str = "auto"  # auto (bf16 autocast on cuda, fp32 on cpu) | fp32 | bf16
    threads: int | None = None  # torch intra-op threads per worker; None: cores / local workers
    max_local_workers: int = 8
    dry_run: bool = False
    force: bool = False


CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def compose_config(*overrides: str, config_name: str = "train") -> TrainConfig:
    """The TrainConfig that `train OVERRIDES...` (or `plan`) would run with, composed in-process."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def register() -> None:
    """Register the schema so YAML files can extend it (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)


register()


CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.norm_position": ("pre", "post"),
    "model.mlp": ("swiglu", "gelu"),
    "model.positions": ("rope", "learned"),
    "data.name": ("stdlib", "tokens"),
    "data.dtype": ("uint16", "uint32"),
    "pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b"),
    "recompute": ("none", "selective", "full"),
    "dtype": ("auto", "fp32", "bf16"),
    "metrics.console": ("auto", "rich", "plain", "none"),
    "metrics.wandb.mode": ("offline", "online", "disabled"),
    "hardware.kind": ("cpu", "cuda", "tpu"),
}


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def positive_int(value: Any, key: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LauncherError(f"{key}={value}: expected a positive integer")


def validate(cfg: TrainConfig, dp: int) -> None:
    """Checks that need no torch and no process: one LauncherError naming the key and the fix."""
    for key, allowed in CHOICES.items():
        if get_key(cfg, key) not in allowed:
            raise LauncherError(f"{key}={get_key(cfg, key)}: choose one of {', '.join(allowed)}")
    m = cfg.model
    for key in (
        "steps",
        "seq_len",
        "model.dim",
        "model.n_layers",
        "model.n_heads",
        "model.ffn_dim",
        "model.vocab_size",
    ):
        positive_int(get_key(cfg, key), key)
    if m.dim % m.n_heads:
        raise LauncherError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}: change either")
    if m.n_kv_heads is not None and (m.n_kv_heads < 1 or m.n_heads % m.n_kv_heads):
        raise LauncherError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if m.positions == "rope" and (m.dim // m.n_heads) % 2:
        raise LauncherError(f"head dim {m.dim // m.n_heads} is odd: RoPE needs an even model.dim / model.n_heads")
    if cfg.seq_len > m.max_seq_len:
        raise LauncherError(
            f"seq_len={cfg.seq_len} exceeds model.max_seq_len={m.max_seq_len} of model '{m.name}': "
            f"lower seq_len or raise model.max_seq_len"
        )
    if cfg.data.name == "stdlib" and m.vocab_size < 256:
        raise LauncherError(f"model.vocab_size={m.vocab_size} is below 256, the byte vocabulary of data=stdlib")
    micro, global_batch = cfg.batch.get("micro"), cfg.batch.get("global")
    positive_int(micro, "batch.micro")
    positive_int(global_batch, "batch.global", allow_none=True)
    if global_batch is not None and global_batch % (micro * dp):
        raise LauncherError(
            f"batch.global={global_batch} is not a multiple of batch.micro x dp = {micro} x {dp}: "
            f"use a multiple of {micro * dp} (e.g. {max(global_batch // (micro * dp), 1) * micro * dp})"
        )
    positive_int(cfg.eval.batches, "eval.batches")
    positive_int(cfg.metrics.log_every, "metrics.log_every")
