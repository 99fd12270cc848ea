"""What a token budget takes (`plan.tokens`): wall-clock days, device-hours and money for one
layout, with the time that failures and checkpoints cost it.

- Steps: `ceil(tokens / tokens_per_step)`; ideal time: steps x the predicted step time.
- Checkpoint save time `C`: the busiest device's checkpoint bytes (fp32 weights and Adam moments,
  `Memory.checkpoint`) over `hardware.storage_gbs`, the write bandwidth each device gets while all
  write at once. A blocking save: `checkpoint.async_save` hides most of it, so C is an upper bound.
- The job's mean time between failures `M`: `hardware.device_mtbf_hours` / devices (one failed
  device stops a synchronous job). Restart `R`: `hardware.restart_s`.
- The checkpoint interval: Young's first-order optimum (J. W. Young, "A first order approximation
  to the optimum checkpoint interval", CACM 17(9), 1974), which Daly derived again with restarts
  (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3), 2006): `tau = sqrt(2 C M)`, the minimum of the overhead `C/tau + tau/(2M)`; valid
  while C << M. Recommended `checkpoint.every` = round(tau / step time), 1 to the run's steps.
- Goodput (Daly's first-order model): the share of wall-clock time that trains. Saving keeps
  `tau / (tau + C)` of it; each failure, one per M of wall-clock time, loses the restart and on
  average half an interval with its save, `R + (tau + C)/2`. So, at the interval the recommended
  `checkpoint.every` gives (whole steps),

      goodput = tau / (tau + C) x (1 - (R + (tau + C)/2) / M)

  and zero when failures come faster than that loss (the run would never finish).
- Wall clock = ideal / goodput; device-hours = wall-clock hours x devices; cost = device-hours x
  `hardware.price_per_hour` (USD; None: no cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.hardware_config import HardwareConfig
from launcher.planner.predict import Prediction

HOUR = 3600.0
DAY = 24 * HOUR
FALLBACKS = 3  # plan.compare_at=budget: smaller node counts tried when no layout fits the rented one


def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that minimise the expected loss: sqrt(2 C M)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of wall-clock time spent training (module docstring), 0 when failures outpace restarts."""
    period = interval_s + save_s
    return interval_s / period * max(0.0, 1.0 - (restart_s + period / 2) / mtbf_s)


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

    @property
    def ideal_s(self) -> float:
        return self.steps * self.step_time_s

    @property
    def wall_s(self) -> float:
        return self.ideal_s / self.goodput if self.goodput > 0 else math.inf

    @property
    def days(self) -> float:
        return self.wall_s / DAY

    @property
    def device_hours(self) -> float:
        return self.wall_s / HOUR * self.devices

    @property
    def cost(self) -> float | None:
        return None if self.price_per_hour is None else self.device_hours * self.price_per_hour

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
        }


def budget(pred: Prediction, tokens: float, hw: HardwareConfig) -> Budget:
    """`tokens` trained on `pred`'s layout of `hw` devices: steps, goodput, days, device-hours, cost."""
    step = pred.step_time_s
    steps = math.ceil(tokens / pred.tokens_per_step)
    devices = pred.layout.world_size
    save = pred.memory.checkpoint / (hw.storage_gbs * 1e9)
    mtbf = hw.device_mtbf_hours * HOUR / devices
    interval = young_daly_interval(save, mtbf)
    every = min(steps, max(1, round(interval / step)))
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
        goodput=goodput(every * step, save, hw.restart_s, mtbf),
        price_per_hour=hw.price_per_hour,
    )


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
