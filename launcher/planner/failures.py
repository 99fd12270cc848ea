"""What failures cost a long run: Young-Daly's checkpoint interval and Daly's goodput for a job that
restarts whole (budget.py's `plan.tokens`), and the same under replica fault tolerance (`ft.replicas`,
docs/fault-tolerance.md), so `plan` can say which a run should use.

Full restart. One failed device stops the job: failures come one per M (the job's mean time between
failures), each costing the restart R and on average half a checkpoint interval with its save C.
- The interval: Young's first-order optimum (J. W. Young, "A first order approximation to the optimum
  checkpoint interval", CACM 17(9), 1974), which Daly derived again with restarts (J. T. Daly, "A
  higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006):
  `tau = sqrt(2 C M)`, the minimum of the overhead `C/tau + tau/(2M)`; valid while C << M.
- Goodput (Daly's first-order model), the share of wall-clock time that trains: saving keeps
  `tau / (tau + C)` of it, and each failure loses `R + (tau + C)/2`, so

      goodput = tau / (tau + C) x (1 - (R + (tau + C)/2) / M)

  and zero when failures come faster than that loss (the run would never finish).

Replica fault tolerance. With N replica groups (each 1/N of the devices) a failure stops one group
only. It restarts and heals from a healthy peer: D = R + H, where H is the busiest device's checkpoint
bytes (weights and optimizer state) over the link between the groups. A group fails at rate
l = 1 / (N M); while it is down the others step on, so the run keeps 1 - l D of its throughput. The
job itself stops only when more than k = N - `ft.min_replicas` groups are down at once: one group
fails (rate N l) while k of the other N - 1 are down (probability C(N-1, k) (l D)^k, first order in
l D), so

    M_stop = 1 / (N l C(N-1, k) (l D)^k)          (k = 0: M, as without ft)

and periodic checkpoints, at Young-Daly's interval for M_stop, cover those stops as before:

    goodput_ft = tau / (tau + C) x (1 - (R + (tau + C)/2) / M_stop) x (1 - l D)

Not modelled: torchft's per-step quorum (a round trip to the Lighthouse, milliseconds), and that a step
while a group is down carries fewer tokens rather than taking longer (the same throughput loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.config.ft import FtConfig

MARGIN = 0.01  # the share of wall-clock time ft must save to be recommended: a dependency, a quorum a step


def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that minimise the expected loss: sqrt(2 C M)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of wall-clock time spent training (module docstring), 0 when failures outpace restarts."""
    period = interval_s + save_s
    return interval_s / period * max(0.0, 1.0 - (restart_s + period / 2) / mtbf_s)


def checkpoint_every(interval_s: float, step_s: float, steps: int) -> int:
    """The interval in whole steps, 1 to the run's steps (all of them: no stop to cover)."""
    return min(steps, max(1, round(interval_s / step_s))) if math.isfinite(interval_s) else steps


@dataclass(frozen=True)
class ReplicaFt:
    """Replica fault tolerance on one layout: its goodput beside the full restart's."""

    replicas: int  # N
    min_replicas: int
    heal_s: float  # H: a restarted group's state fetched from a peer
    downtime_s: float  # D = R + H
    stop_mtbf_s: float  # M_stop: mean time between whole-job stops
    interval_s: float  # Young-Daly's interval for M_stop
    checkpoint_every: int  # steps
    goodput: float
    full_restart_goodput: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "min_replicas": self.min_replicas,
            "heal_s": self.heal_s,
            "downtime_s": self.downtime_s,
            "stop_mtbf_hours": self.stop_mtbf_s / 3600 if math.isfinite(self.stop_mtbf_s) else None,
            "checkpoint_interval_s": self.interval_s if math.isfinite(self.interval_s) else None,
            "checkpoint_every": self.checkpoint_every,
            "goodput": self.goodput,
            "full_restart_goodput": self.full_restart_goodput,
        }


def prefer_ft(full_restart_wall_s: float, ft_wall_s: float) -> bool:
    """Whether replica fault tolerance finishes enough sooner to be worth its dependency and quorum."""
    return ft_wall_s < full_restart_wall_s * (1 - MARGIN)


def groups(ft: FtConfig, dp_replicate: int) -> tuple[int, int] | str:
    """(N, min_replicas) the comparison uses: the user's `ft` where it is on, else one group per replica
    of the layout with the key's default minimum; or why the layout has no replica groups."""
    if ft.on:
        if dp_replicate % ft.replicas:
            return f"ft.replicas={ft.replicas} does not divide this layout's dp_replicate={dp_replicate}"
        return ft.replicas, ft.min_replicas
    if dp_replicate < 2:
        return "no replicated data-parallel dimension to split into groups (needs dp_replicate > 1: hsdp or ddp)"
    return dp_replicate, FtConfig().min_replicas


def stop_mtbf(mtbf_s: float, replicas: int, min_replicas: int, downtime_s: float) -> float:
    """M_stop (module docstring): the mean time between failures that stop the whole job."""
    rate = 1.0 / (replicas * mtbf_s)  # one group's failure rate
    down = replicas - min_replicas  # groups that may be down at once
    stops = replicas * rate * math.comb(replicas - 1, down) * (rate * downtime_s) ** down
    return 1.0 / stops if stops > 0 else math.inf


def replica_ft(
    ft: FtConfig,
    dp_replicate: int,
    *,
    step_s: float,
    steps: int,
    save_s: float,
    restart_s: float,
    mtbf_s: float,
    state_bytes: float,
    peer_bandwidth: float,
    full_restart_goodput: float,
) -> ReplicaFt | str:
    """The module docstring's model for one layout; a reason string where the layout has no groups."""
    chosen = groups(ft, dp_replicate)
    if isinstance(chosen, str):
        return chosen
    n, least = chosen
    heal = state_bytes / peer_bandwidth
    down = restart_s + heal
    m_stop = stop_mtbf(mtbf_s, n, least, down)
    interval = young_daly_interval(save_s, m_stop)
    every = checkpoint_every(interval, step_s, steps)
    alive = max(0.0, 1.0 - down / (n * mtbf_s))
    return ReplicaFt(
        replicas=n,
        min_replicas=least,
        heal_s=heal,
        downtime_s=down,
        stop_mtbf_s=m_stop,
        interval_s=interval,
        checkpoint_every=every,
        goodput=goodput(every * step_s, save_s, restart_s, m_stop) * alive,
        full_restart_goodput=full_restart_goodput,
    )
