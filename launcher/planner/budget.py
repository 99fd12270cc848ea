"""What a token budget takes (`plan.tokens`): wall-clock days, device-hours and money for one
layout, with the time that failures and checkpoints cost it.

- Steps: `ceil(tokens / tokens_per_step)`; ideal time: steps x the predicted step time.
- Checkpoint save time `C`: the busiest device's checkpoint bytes (fp32 weights and Adam moments,
  `Memory.checkpoint`) over `hardware.storage_gbs`, the write bandwidth each device gets while all
  write at once. A blocking save: `checkpoint.async_save` hides most of it, so C is an upper bound.
- The job's mean time between failures `M`: `hardware.device_mtbf_hours` / devices (one failed
  device stops a synchronous job). Restart `R`: `hardware.restart_s`.
- The checkpoint interval (Young-Daly) and the goodput at it (whole steps), with and without replica
  fault tolerance: failures.py. Recommended `checkpoint.every` = round(tau / step time), 1 to the run's steps.
- Wall clock = ideal / goodput; device-hours = wall-clock hours x devices; cost = device-hours x
  `hardware.price_per_hour` (USD; None: no cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.config.ft import FtConfig
from launcher.config.hardware import HardwareConfig
from launcher.hardware.machine import Machine
from launcher.planner.comm import level_of
from launcher.planner.failures import ReplicaFt, checkpoint_every, goodput, groups, replica_ft, young_daly_interval
from launcher.planner.predict import Prediction

HOUR = 3600.0
DAY = 24 * HOUR
FALLBACKS = 3  # plan.compare_at=budget: smaller node counts tried when no layout fits the rented one


@dataclass(frozen=True)
class Budget:
    """Time, device-hours and cost of `tokens` on one layout, failures and checkpoints counted."""

    tokens: float
    steps: int
    tokens_per_step: int
    step_time_s: float
    devices: int
    checkpoint_bytes: float  # per device, the busiest
    save_s: float  # C
    restart_s: float  # R
    mtbf_s: float  # M, the whole job's
    interval_s: float  # tau = sqrt(2 C M)
    checkpoint_every: int  # steps
    goodput: float  # at checkpoint_every x step_time_s
    price_per_hour: float | None  # USD per device-hour
    replica_ft: ReplicaFt | str | None = None  # the same under `ft.replicas` (or why not); None: not asked

    @property
    def ideal_s(self) -> float:
        return self.steps * self.step_time_s

    @property
    def wall_s(self) -> float:
        return self.ideal_s / self.goodput if self.goodput > 0 else math.inf

    @property
    def ft_wall_s(self) -> float:
        """Wall clock under replica fault tolerance (inf where the layout has no groups or never finishes)."""
        ft = self.replica_ft
        return self.ideal_s / ft.goodput if isinstance(ft, ReplicaFt) and ft.goodput > 0 else math.inf

    @property
    def days(self) -> float:
        return self.wall_s / DAY

    @property
    def device_hours(self) -> float:
        return self.wall_s / HOUR * self.devices

    @property
    def cost(self) -> float | None:
        return None if self.price_per_hour is None else self.device_hours * self.price_per_hour

    def _replica_ft_dict(self) -> dict[str, Any]:
        ft = self.replica_ft
        if isinstance(ft, str):
            return {"unavailable": ft}
        assert ft is not None
        days = self.ft_wall_s / DAY
        return {**ft.as_dict(), "days": days if math.isfinite(days) else None}

    def as_dict(self) -> dict[str, Any]:
        def finite(x: float | None) -> float | None:  # JSON has no infinity: a run that never ends is null
            return x if x is None or math.isfinite(x) else None

        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "tokens_per_step": self.tokens_per_step,
            "step_time_s": self.step_time_s,
            "devices": self.devices,
            "ideal_days": self.ideal_s / DAY,
            "checkpoint_bytes_per_rank": round(self.checkpoint_bytes),
            "checkpoint_save_s": self.save_s,
            "restart_s": self.restart_s,
            "mtbf_hours": self.mtbf_s / HOUR,
            "checkpoint_interval_s": self.interval_s,
            "checkpoint_every": self.checkpoint_every,
            "goodput": self.goodput,
            "days": finite(self.days),
            "device_hours": finite(self.device_hours),
            "price_per_hour": self.price_per_hour,
            "cost_usd": finite(self.cost),
            **({} if self.replica_ft is None else {"replica_ft": self._replica_ft_dict()}),
        }


def budget(
    pred: Prediction, tokens: float, hw: HardwareConfig, ft: FtConfig | None = None, machine: Machine | None = None
) -> Budget:
    """`tokens` trained on `pred`'s layout of `hw` devices: steps, goodput, days, device-hours, cost; with
    `ft` and `machine`, replica fault tolerance's goodput beside it (failures.py)."""
    step = pred.step_time_s
    steps = math.ceil(tokens / pred.tokens_per_step)
    devices = pred.layout.world_size
    save = pred.memory.checkpoint / (hw.storage_gbs * 1e9)
    mtbf = hw.device_mtbf_hours * HOUR / devices
    interval = young_daly_interval(save, mtbf)
    every = checkpoint_every(interval, step, steps)
    full = goodput(every * step, save, hw.restart_s, mtbf)
    replicas = None
    if ft is not None and machine is not None:
        replicas = replica_ft(
            ft,
            pred.layout.dp_replicate,
            step_s=step,
            steps=steps,
            save_s=save,
            restart_s=hw.restart_s,
            mtbf_s=mtbf,
            state_bytes=pred.memory.checkpoint,
            peer_bandwidth=peer_bandwidth(machine, devices),
            full_restart_goodput=full,
        )
    return Budget(
        tokens=tokens,
        steps=steps,
        tokens_per_step=pred.tokens_per_step,
        step_time_s=step,
        devices=devices,
        checkpoint_bytes=pred.memory.checkpoint,
        save_s=save,
        restart_s=hw.restart_s,
        mtbf_s=mtbf,
        interval_s=interval,
        checkpoint_every=every,
        goodput=full,
        price_per_hour=hw.price_per_hour,
        replica_ft=replicas,
    )


def ft_budget(
    ranked: list[Prediction], tokens: float, hw: HardwareConfig, ft: FtConfig, machine: Machine
) -> tuple[int, Budget] | None:
    """The fastest layout that splits into replica groups (its rank, from 1) and its budget, replica
    fault tolerance included; None where no layout does."""
    for rank, pred in enumerate(ranked, 1):
        if not isinstance(groups(ft, pred.layout.dp_replicate), str):
            return rank, budget(pred, tokens, hw, ft, machine)
    return None


def peer_bandwidth(machine: Machine, devices: int) -> float:
    """Bytes/s per device between replica groups: the smallest interconnect level spanning the run."""
    return level_of(machine.levels, devices).bandwidth


def compared_nodes(world: int, hw: HardwareConfig, spend_per_hour: float | None) -> list[int]:
    """Node counts of `hw` to plan in `plan.compare`, the first that any layout fits wins: as many
    devices as the run's `world` (whole nodes, rounded up); or, with `spend_per_hour`
    (plan.compare_at=budget), the whole nodes that rents at `hw`'s price, then the largest counts below
    it of the form 2^a or 3 x 2^a (a batch.global of 2^k sequences rarely splits over an arbitrary count)."""
    if spend_per_hour is None:
        return [max(1, math.ceil(world / hw.devices_per_node))]
    assert hw.price_per_hour is not None  # validate.compared_profiles refuses a budget without prices
    rented = max(1, math.floor(spend_per_hour / (hw.price_per_hour * hw.devices_per_node) + 1e-9))
    smooth = {count for a in range(rented.bit_length()) for count in (2**a, 3 * 2**a) if count < rented}
    return [rented, *sorted(smooth, reverse=True)[:FALLBACKS]]


@dataclass(frozen=True)
class Row:
    """One profile of `plan.compare`: its best layout on `nodes` nodes and that layout's budget, or why none."""

    hardware: HardwareConfig
    nodes: int
    prediction: Prediction | None = None
    budget: Budget | None = None
    error: str | None = None

    @property
    def devices(self) -> int:
        return self.nodes * self.hardware.devices_per_node

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"hardware": self.hardware.name, "nodes": self.nodes, "devices": self.devices}
        if self.prediction is None or self.budget is None:
            return {**row, "error": self.error}
        return {**row, "layout": self.prediction.as_dict(), "budget": self.budget.as_dict()}
