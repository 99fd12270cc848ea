"""Learning from measured runs: `plan plan.calibrate=DIR hardware=NAME`.

Every finished run's summary.json records what it measured (median tokens/s), its layout and its
composed config (`config`), so the planner can predict it again on any profile. This fits a few of
the profile's constants to those runs: the share of peak the matmuls sustain (`matmul_efficiency`),
each link level's speed (its bandwidths, and its latency inversely), and where the profile has them
(a CPU) the host times. Each is a
multiplier of the profile's number, bounded by what is physical (an efficiency at most 1, a datasheet
link at most its datasheet rate, a measured number within 10x), fitted by least squares on the log of
predicted over measured step time (the relative error, alike over and under) by Levenberg-Marquardt
on the log multipliers, with a small ridge toward the profile's own numbers. A constant no fitted
run's prediction depends on is kept.

Every third layout (sorted) is held out of the fit: its error before and after shows whether the fit
carries over to layouts it did not see. The calibrated profile is a hardware YAML (launcher/planner/
calibrate.py writes it and prints the table).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.config.hardware import HardwareConfig
from launcher.errors import LauncherError
from launcher.files import shown
from launcher.hardware.machine import Machine
from launcher.hardware.profile import LINK_EFFICIENCY
from launcher.layout import Layout
from launcher.planner.memory import Memory
from launcher.planner.predict import Problem, predict, problem_memory
from launcher.planner.request import recorded_problem

# the host times a profile may carry: Machine attribute -> hardware YAML key
HOST = {
    "host_overhead": "host_overhead_us",
    "block_overhead": "block_overhead_us",
    "optimizer_time": "optimizer_ns_per_param",
    "host_copy_time": "host_copy_ns_per_byte",
}
MEASURED = (0.1, 10.0)  # multipliers of a measured number (no datasheet bounds it)
MIN_EFFICIENCY = 0.01
# per squared log multiplier: the profile's numbers are measured or from datasheets, so a few runs move
# one only as far as their errors insist (x2 costs as much as one run 7% off), not to fit noise
RIDGE = 0.01
HELD_OUT_EVERY = 3  # every third layout, sorted by its label, is held out of the fit
ITERATIONS = 100  # Levenberg-Marquardt steps at most (a handful suffice: the time model is smooth)
STEP = 1e-5  # finite-difference step in log multiplier


@dataclass(frozen=True)
class Observation:
    """One finished run: its layout and problem (on the profile being fitted), and its measured step."""

    run: str  # the run directory
    layout: Layout
    problem: Problem
    memory: Memory
    measured_s: float  # tokens per step / the run's median tokens/s
    threads: int  # per worker

    @property
    def label(self) -> str:
        lay = self.layout
        text = f"{self.problem.model.name} tp{lay.tp} pp{lay.pp} cp{lay.cp} dp{lay.dp_replicate}x{lay.dp_shard}"
        text += f" ep{lay.ep}" if lay.ep > 1 else ""
        text += f" {lay.schedule}" if lay.pp > 1 else ""
        text += f" {lay.recompute}" if lay.recompute != "none" else ""
        return text + f" {lay.micro}x{lay.microbatches}"


@dataclass(frozen=True)
class Knob:
    """One fitted constant: a multiplier of the profile's number, within [lo, hi]."""

    key: str  # the hardware YAML key (links.NAME: that level's speed, its bandwidths up and latency down)
    attr: str  # the Machine attribute, or the level's name
    lo: float
    hi: float


def read_runs(dirs: Sequence[str], hw: HardwareConfig) -> tuple[list[Observation], list[str]]:
    """The finished runs under `dirs` (run or sweep directories, searched recursively), re-predicted on
    `hw`; and one line for each summary left out (failed, preempted, a memory check, no config)."""
    paths = sorted({p.resolve() for d in dirs for p in Path(d).rglob("summary.json")})
    runs, skipped = [], []
    for path in paths:
        summary = json.loads(path.read_text())
        reason = unusable(summary)
        if reason:
            skipped.append(f"{shown(path.parent)}: {reason}")
            continue
        runs.append(observation(path.parent, summary, hw))
    return runs, skipped


def unusable(summary: dict[str, Any]) -> str | None:
    if summary.get("status") == "failed" or "preempted_at_step" in summary:
        return "failed or preempted"
    if not summary.get("median_tokens_per_s"):
        return "no measured steps (steps=0)"
    if "config" not in summary:
        return "no config recorded (a run from before plan.calibrate)"
    return None


def observation(run_dir: Path, summary: dict[str, Any], hw: HardwareConfig) -> Observation:
    record = summary["config"]
    ran_on = record["hardware"]["name"]
    if ran_on.removesuffix("_calibrated") != hw.name.removesuffix("_calibrated"):
        raise LauncherError(
            f"plan.calibrate: {shown(run_dir)} ran on hardware '{ran_on}', not '{hw.name}': pass hardware={ran_on} "
            "(the profile to calibrate), or leave that run out"
        )
    layout = Layout(**summary["layout"])
    prob = recorded_problem(record, hw, summary["world_size"], str(run_dir / "summary.json"))
    tokens = layout.global_batch * record["seq_len"]
    return Observation(
        run=shown(run_dir),
        layout=layout,
        problem=prob,
        memory=problem_memory(prob, layout),
        measured_s=tokens / summary["median_tokens_per_s"],
        threads=summary["threads_per_worker"],
    )


def held_out(runs: Sequence[Observation]) -> set[str]:
    """The labels of every third layout, sorted (none with fewer than three)."""
    labels = sorted({r.label for r in runs})
    return {label for i, label in enumerate(labels) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}


def knobs(hw: HardwareConfig, mach: Machine) -> list[Knob]:
    """The constants of `hw` (as given, before calibration) that a fit may move, with their bounds."""
    eff = mach.matmul_efficiency
    found = [Knob("matmul_efficiency", "matmul_efficiency", MIN_EFFICIENCY / eff, 1.0 / eff)]
    for link in hw.links:
        datasheet = link.bandwidth_gbs is not None and link.efficiency is None
        hi = 1.0 / LINK_EFFICIENCY if datasheet else MEASURED[1]  # a datasheet rate is an upper bound
        found.append(Knob(f"links.{link.name}", link.name, MEASURED[0], hi))
    found += [Knob(key, attr, *MEASURED) for attr, key in HOST.items() if getattr(mach, attr) > 0]
    return found


def scaled(mach: Machine, found: Sequence[Knob], mults: Sequence[float]) -> Machine:
    """`mach` with each knob's number multiplied by its multiplier."""
    links = {k.attr: m for k, m in zip(found, mults) if k.key.startswith("links.")}
    numbers = {k.attr: getattr(mach, k.attr) * m for k, m in zip(found, mults) if not k.key.startswith("links.")}
    # a link level m times as fast: its bandwidths times m, its latency over m
    levels = tuple(lv.time_sliced(links[lv.name]) if lv.name in links else lv for lv in mach.levels)
    return dataclasses.replace(mach, levels=levels, **numbers)


def step_times(runs: Sequence[Observation], found: Sequence[Knob], mults: Sequence[float]) -> list[float]:
    """Each run's predicted step time with the knobs at `mults`."""
    return [
        predict(
            dataclasses.replace(r.problem, machine=scaled(r.problem.machine, found, mults)), r.layout, r.memory
        ).step_time_s
        for r in runs
    ]


def residuals(runs: Sequence[Observation], found: Sequence[Knob], logs: Sequence[float]) -> list[float]:
    """Each run's log(predicted / measured), then the ridge's pull on each log multiplier."""
    predicted = step_times(runs, found, [math.exp(x) for x in logs])
    return [math.log(p / r.measured_s) for p, r in zip(predicted, runs)] + [math.sqrt(RIDGE) * x for x in logs]


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (a small, symmetric positive definite): Gaussian elimination."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b)]
    for i in range(n):
        for k in range(i + 1, n):
            f = m[k][i] / m[i][i]
            m[k] = [x - f * y for x, y in zip(m[k], m[i])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


def seen(runs: Sequence[Observation], found: Sequence[Knob]) -> list[bool]:
    """For each knob, whether doubling it moves any run's prediction."""
    base = step_times(runs, found, [1.0] * len(found))

    def moves(i: int) -> bool:
        doubled = step_times(runs, found, [2.0 if j == i else 1.0 for j in range(len(found))])
        return any(abs(b - d) > 1e-9 * b for b, d in zip(base, doubled))

    return [moves(i) for i in range(len(found))]


def fit(runs: Sequence[Observation], found: Sequence[Knob]) -> list[float]:
    """Each knob's multiplier minimizing the squared residuals within its bounds: Levenberg-Marquardt
    on the log multipliers from 1, each step projected onto the bounds (a knob at a bound that the
    gradient pushes further out sits that step out)."""
    lo, hi = [math.log(k.lo) for k in found], [math.log(k.hi) for k in found]
    x = [0.0] * len(found)
    r = residuals(runs, found, x)
    cost, damping = sum(v * v for v in r), 1e-3
    for _ in range(ITERATIONS):
        jac = jacobian(runs, found, x, r, hi)
        grad = [sum(col[i] * r[i] for i in range(len(r))) for col in jac]
        free = [j for j in range(len(x)) if not (x[j] <= lo[j] and grad[j] > 0 or x[j] >= hi[j] and grad[j] < 0)]
        if not free:
            break
        a = [[sum(u * v for u, v in zip(jac[i], jac[j])) for j in free] for i in free]
        for k in range(len(free)):
            a[k][k] += damping * (a[k][k] + 1e-9)
        step = solve(a, [-grad[j] for j in free])
        trial = list(x)
        for j, d in zip(free, step):
            trial[j] = min(hi[j], max(lo[j], x[j] + d))
        r_trial = residuals(runs, found, trial)
        c_trial = sum(v * v for v in r_trial)
        if c_trial < cost:
            done = cost - c_trial < 1e-12
            x, r, cost, damping = trial, r_trial, c_trial, damping / 3
            if done:
                break
        else:
            damping *= 4
            if damping > 1e8:
                break
    return [math.exp(v) for v in x]


def jacobian(
    runs: Sequence[Observation], found: Sequence[Knob], x: list[float], r: list[float], hi: list[float]
) -> list[list[float]]:
    """d residuals / d log multiplier, one column per knob (forward differences, inward at a bound)."""
    cols = []
    for j in range(len(x)):
        h = STEP if x[j] + STEP <= hi[j] else -STEP
        moved = residuals(runs, found, [*x[:j], x[j] + h, *x[j + 1 :]])
        cols.append([(m - v) / h for m, v in zip(moved, r)])
    return cols
