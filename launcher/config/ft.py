"""`ft`: replica-level fault tolerance on torchft (docs/fault-tolerance.md): the keys and their checks.

The run is `ft.replicas` replica groups, each an ordinary layout over its share of `dp_replicate`,
joined by torchft's Manager, which all-reduces the gradients across the groups that take part in a step.
Pure Python: `plan` and `validate` read it as `train` does."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.extras import require
from launcher.config.ranges import ranged
from launcher.errors import LauncherError

# the gradients cross the groups in buckets of this many bytes, two in flight (launcher/train/replicas.py):
# the copies they take, which the planner counts, are two buckets, not a second set of gradients
BUCKET_BYTES = 64 * 2**20
BUCKETS_IN_FLIGHT = 2
# what the launch side tells a replica group's worker (launcher/launch/ft.py, slurm.py; launcher/train/replicas.py)
START_ENV = "LAUNCHER_FT_START"  # host:port of the store where the groups meet before their first step
REPLICA_ENV = "LAUNCHER_FT_REPLICA"  # ft under SLURM: the replica group this job step is (launcher/launch/slurm.py)
ATTEMPT_ENV = "LAUNCHER_FT_ATTEMPT"  # and how often the script has started it before


@dataclass
class FtConfig:
    replicas: int = ranged(0, ge=0)  # replica groups; 0 or 1: off (one group, today's behaviour)
    min_replicas: int = ranged(1, ge=1)  # groups a step needs: fewer, and the quorum waits for more
    quorum_timeout_s: float = ranged(60.0, gt=0)  # how long a quorum (and a cross-group collective) may wait
    heartbeat_timeout_s: float = ranged(2.0, gt=0)  # a silent group counts as alive this long: the others stall

    @property
    def on(self) -> bool:
        return self.replicas > 1


def check_ft(ft: FtConfig, dp_replicate: int) -> None:
    """One line per mistake, before anything starts: groups that do not split the replicated dimension,
    a minimum above the groups there are, torchft not installed."""
    if not ft.on:
        return
    if dp_replicate % ft.replicas:
        raise LauncherError(
            f"ft.replicas={ft.replicas}: does not divide dp_replicate={dp_replicate}, the dimension the replica "
            f"groups split: set dp_replicate to a multiple of {ft.replicas} (and dp_shard to the rest of dp)"
        )
    if ft.min_replicas > ft.replicas:
        raise LauncherError(
            f"ft.min_replicas={ft.min_replicas}: more than ft.replicas={ft.replicas}: no step could ever run; "
            f"set ft.min_replicas <= {ft.replicas}"
        )
    require("torchft", what=f"ft.replicas={ft.replicas}")
