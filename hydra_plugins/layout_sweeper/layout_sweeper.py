"""A Hydra sweeper that asks the planner which layouts to run.

`train -m hydra/sweeper=layouts sweep.top=4 [sweep.world=8] [seed=1,2 ...]` enumerates the valid
layouts of the world size (`sweep.world`, default: nodes x devices per node, as `plan` counts them),
ranks them by predicted step time, and launches the best `sweep.top`, each as a job with overrides
`tp= pp= dp= dp_shard= dp_replicate=` (and batch.micro / pp_schedule / recompute where those are auto).
Degrees given on the command line stay fixed; the others are searched. Other overrides apply to every
job; comma lists among them multiply the jobs as with the basic sweeper. Any launcher works
(`hydra/launcher=slurm` submits the layouts as one job array).
"""

# No `from __future__ import annotations`: Hydra scans plugins with exec_module, outside sys.modules,
# where dataclasses cannot resolve string annotations.
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser

import launcher.launch.slurm  # noqa: F401  (importing it registers the ${slurm_job:...} resolver, before configs resolve)
from launcher.compat.hydra_compat import basic_sweeper
from launcher.config.schema import TrainConfig
from launcher.config.validate import validate
from launcher.layout import DEGREES

from .fixed_batch import FixedBatch, point_config

log = logging.getLogger(__name__)


@dataclass
class LayoutSweeperConf:
    _target_: str = "hydra_plugins.layout_sweeper.layout_sweeper.LayoutSweeper"
    max_batch_size: int | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="layouts", node=LayoutSweeperConf, provider="launcher")


def ranked_layouts(cfg: TrainConfig, top: int, world: int | None = None) -> list[tuple[list[str], dict[str, Any]]]:
    """The best `top` distinct layouts of `cfg` on `world` devices: (overrides, prediction) each."""
    from launcher.config.layout_keys import plan_world_size
    from launcher.planner import plan

    world = world or plan_world_size(cfg)
    _, res = plan(cfg, world, explore=False)
    chosen: list[tuple[list[str], dict[str, Any]]] = []
    seen: set[tuple[str, ...]] = set()
    for pred in res.ranked:
        lay = pred.layout
        overrides = [f"tp={lay.tp}", f"pp={lay.pp}", f"dp={lay.dp}"]
        overrides += [f"dp_shard={lay.dp_shard}", f"dp_replicate={lay.dp_replicate}"]
        if cfg.batch.get("micro") == "auto":
            overrides.append(f"batch.micro={lay.micro}")
        if cfg.pp_schedule == "auto":
            overrides += [f"pp_schedule={lay.schedule}", f"virtual_stages={lay.chunks}"]
        if cfg.recompute == "auto":
            overrides.append(f"recompute={lay.recompute}")
        if cfg.recompute_layers == "auto":
            overrides.append(f"recompute_layers={lay.recompute_layers}")
        if tuple(overrides) in seen:
            continue
        seen.add(tuple(overrides))
        chosen.append((overrides, pred.as_dict()))
        if len(chosen) == top:
            break
    return chosen


def search_config(primary: Any, fixed: set[str]) -> TrainConfig:
    """The TrainConfig of the sweep's primary config with every degree not in `fixed` set to auto."""
    return dataclasses.replace(point_config(primary), **{k: "auto" for k in DEGREES if k not in fixed})


class LayoutSweeper(FixedBatch, basic_sweeper()):
    def __init__(self, max_batch_size: int | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=None)

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed = parser.parse_overrides(arguments)
        fixed = {o.key_or_group for o in parsed if o.key_or_group in DEGREES and not o.is_sweep_override()}
        # a LauncherError reaches the CLI as it is (launcher.compat.hydra_compat.hydra_errors_raised): one line, exit 2
        cfg = search_config(self.config, fixed)
        validate(cfg)  # as plan and train check first: ranges (sweep.top, sweep.world among them)
        layouts = ranked_layouts(cfg, cfg.sweep.top, cfg.sweep.world)
        base = self.split_arguments(parsed, None)[0] if parsed else [[]]
        jobs = [[*b, *lay] for b in base for lay, _ in layouts]
        for rank, (lay, pred) in enumerate(layouts, 1):
            log.info(
                f"layout #{rank}: {' '.join(lay)} (predicted {pred['tokens_per_s']:.0f} tokens/s, "
                f"MFU {pred['mfu']:.1%})"
            )
        size = self.max_batch_size or len(jobs)
        self.overrides = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        self.batch_index = 0
        returns = []
        initial_job_idx = 0
        while not self.is_done():
            batch = self.get_job_batch()
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for r in results:
                _ = r.return_value
            initial_job_idx += len(batch)
            returns.append(results)
        return returns
