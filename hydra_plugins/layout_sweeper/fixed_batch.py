"""One global batch for every point of a sweep, as Megatron keeps it.

Without `batch.global` a point trains `micro x microbatches x dp` sequences a step, and the microbatch
count defaults to 2 x pp with pipelining: a `pp=2` point would train more than a `pp=1` one, and the
sweep would compare unlike runs. Before the first job starts, `FixedBatch` composes every point, and
where their default global batches differ it gives each job `batch.global=` their least common multiple
(each point's own batch divides it: only the microbatch count changes). A sweep that sets the batch
itself (`batch.global` or `microbatches`, swept or not) is left as it is.
"""

# No `from __future__ import annotations`: Hydra scans plugins with exec_module (see layout_sweeper.py).
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf, open_dict

from launcher.compat.hydra_compat import basic_sweeper
from launcher.config.schema import TrainConfig
from launcher.errors import LauncherError

log = logging.getLogger(__name__)
BATCH_KEYS = ("batch.global", "microbatches")  # a sweep that sets either chooses its batches itself


def point_config(primary: Any) -> TrainConfig:
    """A composed job config (with its `hydra` node) as the TrainConfig the job gets."""
    cfg = OmegaConf.create(primary)  # a copy
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))


def default_global_batch(cfg: TrainConfig) -> int | None:
    """The sequences a step of this point trains without `batch.global`; None where the point cannot
    be resolved (its job will fail with its own one-line error, recorded in the sweep summary)."""
    from launcher.planner import resolve

    try:
        return resolve(dataclasses.replace(cfg, dry_run=True))[0].global_batch
    except LauncherError:
        return None


def common_batch(batches: Sequence[int | None]) -> int | None:
    """The one global batch of the sweep where the points' defaults differ, else None."""
    known = [b for b in batches if b]
    return math.lcm(*known) if len(set(known)) > 1 else None


class FixedBatch:
    """A mixin for a Hydra sweeper: on its first batch of jobs, every job gets the sweep's common
    `batch.global` (see the module docstring)."""

    pinned: int | None = None

    def get_job_batch(self) -> Sequence[Sequence[str]]:
        if self.batch_index == 0:  # type: ignore[attr-defined]
            self.pinned = self.fixed_batch([job for batch in self.overrides for job in batch])  # type: ignore[attr-defined]
        jobs = super().get_job_batch()  # type: ignore[misc]
        return [[*job, f"batch.global={self.pinned}"] for job in jobs] if self.pinned else jobs

    def fixed_batch(self, jobs: list[Sequence[str]]) -> int | None:
        if len(jobs) < 2 or any(o.split("=")[0].lstrip("+~") in BATCH_KEYS for job in jobs for o in job):
            return None
        loader = self.hydra_context.config_loader  # type: ignore[attr-defined]
        configs = [point_config(loader.load_sweep_config(self.config, list(job))) for job in jobs]  # type: ignore[attr-defined]
        if configs[0].batch.get("global") is not None or configs[0].microbatches is not None:
            return None
        batches = [default_global_batch(c) for c in configs]
        pinned = common_batch(batches)
        if pinned:
            common = set.intersection(*(set(job) for job in jobs))
            points = [" ".join(o for o in job if o not in common) for job in jobs]
            each = ", ".join(f"{point}: {b}" for point, b in zip(points, batches) if b)
            log.info(f"every point trains batch.global={pinned} (defaults {each}); set batch.global to choose")
        return pinned


class FixedBatchSweeper(FixedBatch, basic_sweeper()):
    """Hydra's basic sweeper (comma lists, `hydra.sweeper.params`), one global batch for every point."""


@dataclasses.dataclass
class FixedBatchSweeperConf:
    _target_: str = "hydra_plugins.layout_sweeper.fixed_batch.FixedBatchSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="fixed_batch", node=FixedBatchSweeperConf, provider="launcher")
