"""The one Layout, and every rule about layouts, once each.

core.py      the frozen `Layout`, the rank order, the stage split
schedules.py the pipeline schedules, one row each (placement, rules, bubble, in flight, search, torch class)
degrees.py   int-or-auto, the world-size rule, the data-parallel split, the microbatch rule
rules.py     the validity rules `plan` and `train` both apply (`violations`, `check`)
mesh.py      rank at coordinates, the output's owner, the DeviceMesh, workers and threads
text.py      the layout in one line for people (the run's header, the planner's tables)

The layout never reads a config (a model's shape comes as `flops.ModelShape`): the Layout a config
fixes, and the world size it plans for, are launcher/config/layout_keys.py's. This package's public
names are re-exported here.
"""

from launcher.layout.core import (
    DEGREES,
    MESH_DIMS,
    RECOMPUTE,
    RESHARD,
    Layout,
    rank_stages,
    stage_layers,
    stage_size,
)
from launcher.layout.degrees import (
    check_world,
    divisors,
    fixed_degrees,
    int_or_auto,
    microbatch_count,
    recompute_layers_of,
    split_dp,
)
from launcher.layout.mesh import build_mesh, expert_mesh, owner_rank, rank_of, worker_threads, workers_per_node
from launcher.layout.rules import async_tp_applies, check, expert_split, violations
from launcher.layout.schedules import SCHEDULE, SCHEDULES, Schedule
from launcher.layout.text import degrees_text, describe, dp_text, schedule_text

__all__ = [
    "DEGREES",
    "MESH_DIMS",
    "RECOMPUTE",
    "RESHARD",
    "SCHEDULE",
    "SCHEDULES",
    "Layout",
    "Schedule",
    "async_tp_applies",
    "build_mesh",
    "check",
    "check_world",
    "degrees_text",
    "describe",
    "divisors",
    "dp_text",
    "expert_mesh",
    "expert_split",
    "fixed_degrees",
    "int_or_auto",
    "microbatch_count",
    "owner_rank",
    "schedule_text",
    "rank_of",
    "rank_stages",
    "recompute_layers_of",
    "split_dp",
    "stage_layers",
    "stage_size",
    "violations",
    "worker_threads",
    "workers_per_node",
]
