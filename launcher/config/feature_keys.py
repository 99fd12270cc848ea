"""Which keys belong to which feature, and the switch that turns it on: one table (`FEATURES`) and one rule
(`check_feature_keys`): a key a feature alone reads, set (away from its schema default) while that feature is
off, is refused in one line naming the key and the switch (`ft.quorum_timeout_s=5` without `ft.replicas`
would otherwise be dropped silently); where ignoring it costs nothing (`checkpoint.keep` with checkpoints
off) it is one warning line instead. `validate` runs it, so `plan` and `train` refuse the same configs.
Pipeline keys without a pipeline (pp_schedule, virtual_stages) are the layout's own rule
(launcher/layout/rules.py), as they depend on the degree the planner picks. No torch here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from launcher.config.model import MoEConfig
from launcher.config.schema import TrainConfig
from launcher.errors import LauncherError


def hydra_choice(group: str, option: str) -> bool:
    """This command runs with `option` of a Hydra group (hydra/launcher, hydra/sweeper), or may: outside a
    job of hydra.main (the compose API, a sweeper planning its points) the choice is not known."""
    from hydra.core.hydra_config import HydraConfig

    return not HydraConfig.initialized() or HydraConfig.get().runtime.choices.get(group) == option


def slurm_on(cfg: TrainConfig) -> bool:
    """The slurm.* keys are read by `slurm.emit`, by `-m hydra/launcher=slurm`, and inside a SLURM job
    (an emitted or submitted job runs the config that holds them)."""
    return cfg.slurm.emit or hydra_choice("hydra/launcher", "slurm") or "SLURM_JOB_ID" in os.environ


def int_is(value: Any, number: int) -> bool:
    """A degree fixed to `number` (auto: the planner may choose another)."""
    return isinstance(value, int) and value == number


@dataclass(frozen=True)
class Feature:
    switch: str  # what turns it on, as the user types it
    on: Callable[[TrainConfig], bool]
    keys: tuple[str, ...]  # the keys only this feature reads
    harmless: bool = False  # ignoring them changes nothing the user asked for: a warning, not a refusal


MOE_KEYS = tuple(f"model.moe.{f.name}" for f in fields(MoEConfig) if f.name != "experts")
SLURM_KEYS = tuple(f"slurm.{k}" for k in ("partition", "account", "time_min", "tasks_per_node", "cpus_per_task"))

FEATURES = (
    Feature(
        "ft.replicas=2 or more", lambda c: c.ft.on, ("ft.min_replicas", "ft.quorum_timeout_s", "ft.heartbeat_timeout_s")
    ),
    Feature("data=mix", lambda c: c.data.name == "mix", ("data.sources",)),
    Feature("data=tokens or data=text", lambda c: c.data.name != "stdlib", ("data.path",)),
    Feature("data=tokens", lambda c: c.data.name in ("tokens", "mix"), ("data.dtype", "data.val_path", "data.eos_id")),
    Feature("data=text", lambda c: c.data.name in ("text", "mix"), ("data.tokenizer", "data.text_key", "data.workers")),
    Feature("data.document_mask=true", lambda c: c.data.document_mask, ("data.document_len",)),
    Feature("dtype=fp8", lambda c: c.dtype == "fp8", ("fp8.recipe", "fp8.emulate", "fp8.min_features")),
    Feature("model.moe.experts=N (a mixture of experts)", lambda c: c.model.moe.experts > 0, MOE_KEYS),
    Feature(
        "guard.spike=skip or rollback",
        lambda c: c.guard.spike != "off",
        ("guard.spike_factor", "guard.window", "guard.warmup", "guard.max_rollbacks"),
    ),
    Feature("guard.spike=rollback", lambda c: c.guard.spike == "rollback", ("guard.snapshot_every", "guard.snapshot")),
    Feature("profile.start=N", lambda c: c.profile.start is not None, ("profile.steps",)),
    Feature("steps=0", lambda c: c.steps == 0, ("smoke",)),
    Feature(
        "dp_shard=2 or more (FSDP)",
        lambda c: not (int_is(c.dp_shard, 1) or int_is(c.dp, 1)),
        ("fsdp.reshard_after_forward",),
    ),
    Feature(
        "slurm.emit=true or -m hydra/launcher=slurm",
        slurm_on,
        (*SLURM_KEYS, "slurm.signal_delay_s", "slurm.max_requeues"),
    ),
    Feature("slurm.emit=true", lambda c: c.slurm.emit or "SLURM_JOB_ID" in os.environ, ("slurm.script",)),
    Feature("-m hydra/launcher=slurm", lambda c: hydra_choice("hydra/launcher", "slurm"), ("slurm.dry_run",)),
    Feature(
        "-m hydra/sweeper=layouts", lambda c: hydra_choice("hydra/sweeper", "layouts"), ("sweep.top", "sweep.world")
    ),
    Feature("metrics.wandb.mode=online", lambda c: c.metrics.wandb.mode == "online", ("metrics.wandb.init_timeout_s",)),
    Feature("hardware=cpu", lambda c: c.hardware.kind == "cpu", ("cpu_allocator",), harmless=True),
    Feature(
        "checkpoint.every=N",
        lambda c: c.checkpoint.every > 0,
        ("checkpoint.keep", "checkpoint.async_save", "checkpoint.on_error"),
        harmless=True,
    ),
    Feature("eval.every=N", lambda c: c.eval.every > 0, ("eval.batches",), harmless=True),
    Feature(
        "metrics.wandb.mode=offline or online",
        lambda c: c.metrics.wandb.mode != "disabled",
        ("metrics.wandb.project", "metrics.wandb.entity", "metrics.wandb.name"),
        harmless=True,
    ),
)


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def check_feature_keys(cfg: TrainConfig) -> None:
    """Every key of a feature that is off holds its default: one LauncherError naming the first that does
    not and the switch (a warning line for harmless ones)."""
    default = TrainConfig()
    for feature in FEATURES:
        given = [k for k in feature.keys if get_key(cfg, k) != get_key(default, k)]
        if not given or feature.on(cfg):
            continue
        key = given[0]
        line = f"{key}={get_key(cfg, key)} is read only with {feature.switch}, which this run does not set"
        if not feature.harmless:
            raise LauncherError(f"{line}: set {feature.switch.split(' or ')[0].split(' (')[0]}, or drop {key}")
        print(f"warning: {line}: {key} is ignored", file=sys.stderr)
