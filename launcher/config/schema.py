"""The typed configuration schema: every key, its type, its default and (numeric keys) its range.

TrainConfig and its sections live here, the model's keys in model.py, a hardware profile's in hardware.py, the numeric
ranges in ranges.py; the checks that span keys are validate.py's. Registered in Hydra's ConfigStore as
``base_train``; the YAML files under launcher/conf/ only override. This module must not import torch:
`plan` composes the same schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from launcher.config.ft import FtConfig
from launcher.config.hardware import HardwareConfig
from launcher.config.model import ModelConfig
from launcher.config.ranges import Range, ranged


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | tokens | text | mix
    path: str | None = None  # flat token file (data=tokens); text files or globs, comma-separated (data=text)
    dtype: str = "uint16"  # uint16 | uint32 for data=tokens
    val_path: str | None = None  # separate validation token file; None: hold out val_fraction
    val_fraction: float = ranged(0.02, gt=0, lt=1)
    max_bytes: int = ranged(16_000_000, ge=1)  # stdlib corpus size cap (bytes of source)
    cache_dir: str = "${cache_dir}"  # the tokenized corpus
    tokenizer: str | None = None  # data=text: a Hugging Face tokenizer.json or a local model folder
    text_key: str = "text"  # data=text: the field of a .jsonl/.parquet row that holds the document
    workers: int | None = ranged(None, ge=1, integer=True)  # data=text: tokenizing threads (None: one per core)
    # data=mix: source dicts (the keys above, a `weight` > 0, a `label`; unset keys: this section's; docs/data.md)
    sources: list[Any] = field(default_factory=list)
    document_mask: bool = False  # attention within each packed document, positions restarting (docs/data.md)
    eos_id: int | None = ranged(None, ge=0, integer=True)  # data=tokens: the id that ends every document
    document_len: int = ranged(2048, ge=1, integer=True)  # the planner's typical document length (tokens)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = ranged(3e-3, gt=0, le=1)  # AdamW: a step of lr per parameter; above 1 it diverges at once
    min_lr_ratio: float = ranged(0.1, ge=0, le=1)  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = ranged(20, ge=0)
    weight_decay: float = ranged(0.1, ge=0)
    beta1: float = ranged(0.9, ge=0, lt=1)
    beta2: float = ranged(0.95, ge=0, lt=1)
    eps: float = ranged(1e-8, gt=0)
    grad_clip: float = ranged(1.0, ge=0)  # 0 disables clipping
    # a step whose loss or gradient norm is NaN/inf: false stops the run (exit 3), true skips its update
    skip_nonfinite: bool = False


def default_batch() -> dict[str, Any]:
    """`batch.micro`: sequences per microbatch per data-parallel rank (int or auto). `batch.global`:
    sequences per optimizer step over all ranks, always micro x microbatches x dp (None: whatever
    `microbatches` makes it; the rule is `layout.microbatch_count`). A dict, not a dataclass,
    because `global` is a Python keyword; BATCH_RANGES gives the types Hydra does not check."""
    return {"micro": 8, "global": None}


BATCH_RANGES = {
    "micro": Range(ge=1, integer=True, optional=False, auto=True),
    "global": Range(ge=1, integer=True),
}


def default_init() -> dict[str, Any]:
    """`init.from`: a Hugging Face Llama folder (config.json + safetensors) to start from instead of
    random weights (None: random). A dict, like `batch`, because `from` is a Python keyword."""
    return {"from": None}


@dataclass
class ProfileConfig:
    """torch.profiler over steps start .. start + steps - 1, a trace per rank under run_dir/profile/."""

    start: int | None = ranged(None, ge=1, integer=True)  # None: no profiling
    steps: int = ranged(1, ge=1)
    memory: bool = False  # cuda: also a memory snapshot (torch.cuda.memory) per rank


@dataclass
class EvalConfig:
    every: int = ranged(50, ge=0)  # steps between validation passes; 0 disables
    batches: int = ranged(4, ge=1)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "launcher"
    entity: str | None = None
    name: str | None = None
    # online: seconds to reach the server before the run falls back to offline (sync it later)
    init_timeout_s: float = ranged(15.0, gt=0)


@dataclass
class MetricsConfig:
    log_every: int = ranged(1, ge=1)
    console: str = "auto"  # auto (rich panel on a terminal, lines otherwise) | rich | plain | none
    # a mixture of experts: a table of each MoE layer's load (max/mean tokens, min/max expert, bias, dropped)
    # under the console's figures at each logged step (launcher/metrics/moe_load.py)
    moe_table: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    every: int = ranged(100, ge=0)  # steps between checkpoints (and one at the end); 0 disables
    keep: int = ranged(2, ge=1)  # complete checkpoints kept; older ones are deleted once a newer one is complete
    dir: str | None = None  # None: <run_dir>/checkpoints
    async_save: bool = False  # write in the background while training continues
    on_error: str = "continue"  # a failed periodic save: continue (a warning) | stop (exit 1); a final one stops


@dataclass
class GuardConfig:
    """Loss spikes (launcher/train/spike.py): a step whose loss or gradient norm exceeds `spike_factor` x its
    median over the last `window` steps; steps up to `warmup` are neither checked nor counted in the median."""

    spike: str = "off"  # off | skip (drop that step's update) | rollback (to the last snapshot, skipping its batches)
    spike_factor: float = ranged(5.0, gt=1)
    window: int = ranged(50, ge=1)
    warmup: int = ranged(100, ge=0)
    max_rollbacks: int = ranged(3, ge=0)  # rollbacks in a run; the next spike stops it (exit 3)
    snapshot_every: int = ranged(20, ge=1)  # rollback: steps between in-memory snapshots (and at each checkpoint)
    snapshot: str = "host"  # rollback: where the snapshot lives, host memory | device (faster, costs device memory)
    # [[first, last], ...]: global batches (numbered from 1, as steps number them without skips) never trained on
    skip_batches: list[list[int]] = field(default_factory=list, metadata={"range": Range(ge=1, integer=True)})


@dataclass
class WatchdogConfig:
    # seconds a rank may stay in one phase of a step (data, forward_backward, optimizer, eval) before the
    # run stops naming it (launcher/train/watchdog.py; setup, the first step and checkpoints get 5x);
    # None: 20 predicted step times, at least 60 s on CPU, 300 s on GPUs; 0: off
    timeout_s: float | None = ranged(None, ge=0)


@dataclass
class PlanConfig:
    top: int = ranged(10, ge=0)  # 0: all layouts
    format: str = "table"  # table | wide (every column at any width) | json
    # plan app: also choose sequence_parallel and virtual_stages (`train` fills only keys set to auto)
    explore: bool = False
    # a token budget (e.g. 15e12): days, device-hours, cost and failures' toll for the best layout (planner/budget.py)
    tokens: float | None = ranged(None, gt=0)
    # hardware profiles side by side for plan.tokens, each with its own best layout (e.g.
    # [h100_sxm,b200,tpu_v5p]); compare_at: the same device count (devices), or the devices the
    # run's own profile's hourly spend rents (budget)
    compare: list[str] = field(default_factory=list)
    compare_at: str = "devices"  # devices | budget
    # a run or sweep directory, or a list of them ([DIR,DIR]), whose summary.json files the planner fits
    # the hardware profile's constants to (launcher/planner/calibrate_fit.py); None: plan as usual
    calibrate: Any = None
    calibrate_out: str = "calibrated"  # the calibrated profile goes to DIR/hardware/<profile>_calibrated.yaml
    chart: str | None = None  # compare's bars / calibrate's fit as a PNG; None: none, calibrate's beside its YAML


@dataclass
class SweepConfig:
    """The layout sweeper (`-m hydra/sweeper=layouts`): run the planner's best `top` layouts."""

    top: int = ranged(4, ge=1)
    # devices to plan for; None: nodes x devices per node (cpu: max_local_workers)
    world: int | None = ranged(None, ge=1, integer=True)


@dataclass
class SlurmConfig:
    """SLURM: the submitit launcher (`-m hydra/launcher=slurm`) reads these; `emit` writes an sbatch script."""

    emit: bool = False  # write an sbatch script that runs this resolved config, print its path, submit nothing
    dry_run: bool = False  # print what would be submitted, submit nothing
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    time_min: int = ranged(60, ge=1)  # time limit (minutes)
    # None: from the layout (cpu) or hardware.devices_per_node (cuda)
    tasks_per_node: int | None = ranged(None, ge=1, integer=True)
    cpus_per_task: int | None = ranged(None, ge=1, integer=True)  # None: threads if set, else 1 (cuda: 8)
    signal_delay_s: int = ranged(90, ge=0)  # SIGUSR1 this long before the time limit: checkpoint, then requeue
    max_requeues: int = ranged(3, ge=0)  # requeues after a time limit (preemptions always requeue)
    script: str | None = None  # slurm.emit: where to write it; None: <run_dir>/job.sbatch


@dataclass
class FSDPConfig:
    """FSDP2 (dp_shard > 1). reshard_after_forward: always (ZeRO-3: parameters re-gathered for
    backward), never (ZeRO-2: kept gathered from forward to backward, gradients and optimizer state
    still sharded), auto (torchtitan's default by stage: always without pipelining, never with it)."""

    reshard_after_forward: str = "auto"


@dataclass
class Fp8Config:
    """dtype=fp8: torchao's float8 training of the blocks' linear layers (docs/precision.md)."""

    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp (torchao's recipes)
    emulate: bool = False  # quantize, dequantize, matmul in high precision: any device (CPU tests, config checks)
    # layers with in or out features below this stay high precision: their casts cost more than fp8 gains
    min_features: int = ranged(1024, ge=1)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: dict[str, Any] = field(default_factory=default_batch, metadata={"ranges": BATCH_RANGES})
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    ft: FtConfig = field(default_factory=FtConfig)  # replica groups on torchft (launcher/config/ft.py)
    init: dict[str, Any] = field(default_factory=default_init)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    steps: int = ranged(100, ge=0, le=10**9)  # 100: `train` in a minute; 0: build the shards, report memory, stop
    smoke: bool = False  # with steps=0: also run one forward/backward on one microbatch
    seq_len: int = ranged(256, ge=1)
    seed: int = ranged(1234, ge=0, le=2**64 - 1)  # torch.manual_seed's range
    run_dir: str | None = None  # None: Hydra's output directory
    cache_dir: str = "${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/launcher"  # corpus, CPU calibration
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | never | PATH
    max_restarts: int = ranged(0, ge=0)  # local workers: restart the group this often after a failure

    # layout: degrees are ints or "auto" (checked by launcher/layout/, not by a Range)
    nodes: int = ranged(1, ge=1)
    ep: Any = 1  # expert parallel: routed experts split over ep ranks carved from dp_shard (int or auto)
    tp: Any = 1
    pp: Any = 1
    cp: Any = 1  # context parallel: each sequence split over cp ranks (2 cp chunks, load-balanced)
    dp: Any = "auto"  # whatever ranks remain
    dp_shard: Any = "auto"  # FSDP degree inside dp; auto: all of dp (1 = plain DDP)
    dp_replicate: Any = "auto"  # DDP degree inside dp (HSDP when both > 1)
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"  # a schedule of launcher/layout/schedules.py, or auto (the planner's choice)
    # per step per dp rank (pipeline microbatches, or accumulation steps without pipelining);
    # None: batch.global / (batch.micro x dp), or 2 x pp without batch.global (1 without pipelining)
    microbatches: int | None = None
    virtual_stages: int = 1  # interleaved schedules; a V (zbv, dualpipev) always holds 2 per rank
    recompute: str = "none"  # none | selective | full | auto
    # blocks of each pipeline stage (each model chunk) recomputed in full, the rest per `recompute`;
    # auto: the planner's smallest count that fits (launcher/parallel/recompute.py)
    recompute_layers: Any = 0

    compile: Any = "auto"  # torch.compile per block: true | false | auto (on for cuda, off for cpu)
    # torch's async tensor parallelism (cuda, with compile and sequence_parallel): the TP all-gathers
    # and reduce-scatters run in chunks overlapped with the matmuls they feed (the planner hides them)
    async_tp: bool = False
    # bf16 on cuda, fp32 on cpu; bf16 is FSDP2's mixed-precision policy where cuda shards with FSDP,
    # autocast elsewhere (launcher/config/precision.py); fp8: the blocks' matmuls in float8 (fp8.*), the rest as bf16
    dtype: str = "auto"  # auto | fp32 | bf16 | fp8
    # a collective waiting longer fails the run (NCCL, gloo); None: 600 s or past the watchdog's first step
    nccl_timeout_s: int | None = ranged(None, ge=1, integer=True)
    # CPU workers' glibc malloc (launcher/train/allocator.py): fast keeps freed blocks for reuse (no page faults per
    # large tensor; peak RSS includes glibc's cache), lean returns blocks of 4 MiB and more to the system (peak
    # RSS is the run's tensors; slower); auto: lean for a `steps=0` memory check, fast for training
    cpu_allocator: str = "auto"
    threads: int | None = ranged(None, ge=1, integer=True)  # torch intra-op threads per worker; None: cores / workers
    max_local_workers: int = ranged(8, ge=1)
    dry_run: bool = False
    # one training step of one rank per pipeline position on fake tensors, no process started: peak memory per
    # category beside the planner's (launcher/simulate/, docs/simulate.md)
    simulate: bool = False
    force: bool = False


CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")  # package data: found from an installed wheel too


def compose_config(*overrides: str, config_name: str = "train") -> TrainConfig:
    """The TrainConfig that `train OVERRIDES...` (or `plan`) would run with, composed in-process."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def register() -> None:
    """The schema, for YAML files to extend; `${run_dir_or:..}`: hydra.run.dir is `run_dir` where given. Idempotent."""
    ConfigStore.instance().store(name="base_train", node=TrainConfig)
    if not OmegaConf.has_resolver("run_dir_or"):
        OmegaConf.register_new_resolver("run_dir_or", lambda given, default: given or default)


register()


def compile_enabled(cfg: TrainConfig) -> bool:
    """`compile=auto`: on for cuda (it fuses the blocks' elementwise work), off on a CPU (costs more than it saves)."""
    return cfg.hardware.kind == "cuda" if cfg.compile == "auto" else bool(cfg.compile)
