"""A pipeline schedule's timeline from its action order: when each action runs, how many
microbatches each rank holds activations for, and the schedule drawn as text.

An action is (kind, microbatch, stage): kind F (forward), B (full backward), I (input gradient)
or W (weight gradient). Each rank runs its actions in its given order, each as soon as the rank is
free and its inputs exist: F of stage s after F of s - 1; B or I of s after B or I of s + 1 (the
last stage after its own F); W after the I of the same stage. Costs are per kind, in units of one
stage's forward; p2p is free. Where the order comes from torch (`compat.pipeline_compat.schedule_actions`) this is
the timeline torch runs; the planner's closed forms (compute.py, cost.py, memory.py) are tested against it.

A microbatch's activations on a stage are alive from its F to its B, or to its W: torch's input
backward keeps the graph (`retain_graph=True`) for the weight backward. `in_flight` and `logits_in_flight`
are the closed forms of those peaks that the planner's memory (memory.py) reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.layout import Layout

Action = tuple[str, int, int]  # (kind, microbatch, stage)
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # backward = 2 forwards, split evenly


@dataclass(frozen=True)
class Timeline:
    spans: dict[int, list[tuple[float, float, Action]]]  # per rank: (start, end, action), in run order

    @property
    def makespan(self) -> float:
        return max((s[-1][1] for s in self.spans.values() if s), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(end - start for start, end, _ in self.spans[rank])

    def bubble(self) -> float:
        """Idle time of the busiest rank: the makespan less its own work."""
        return self.makespan - max(self.busy(r) for r in self.spans)


def simulate(orders: Mapping[int, Sequence[Action]], costs: Mapping[str, float] = UNIT_COSTS) -> Timeline:
    """Run every rank's order (see the module docstring); raises if the orders deadlock."""
    last_stage = max(a[2] for order in orders.values() for a in order)
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}
    spans: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in orders}
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, order in orders.items():
            while pos[r] < len(order):
                kind, mb, s = action = order[pos[r]]
                ready = _ready(kind, mb, s, last_stage, done)
                if ready is None:
                    break
                start = max(free[r], ready)
                end = start + costs[kind]
                done["I" if kind == "B" else kind, mb, s] = end
                if kind == "B":
                    done["W", mb, s] = end
                spans[r].append((start, end, action))
                free[r], pos[r] = end, pos[r] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[pos[r]] for r, order in orders.items() if pos[r] < len(order)}
            raise ValueError(f"the orders deadlock: next actions {stuck}")
    return Timeline(spans)


def _ready(kind: str, mb: int, s: int, last_stage: int, done: dict) -> float | None:
    """When the action's inputs exist (None: not yet)."""
    if kind == "F":
        deps = [("F", mb, s - 1)] if s > 0 else []
    elif kind in ("B", "I"):
        deps = [("F", mb, s)] + ([("I", mb, s + 1)] if s < last_stage else [])
    else:
        deps = [("I", mb, s)]
    times = [done.get(d) for d in deps]
    return None if any(t is None for t in times) else max(times, default=0.0)


def peak_in_flight(order: Sequence[Action], weight: Mapping[int, float] | None = None) -> float:
    """The most (microbatch, stage) activations one rank holds at once, each weighted by its stage's
    `weight` (e.g. its share of the rank's layers; default 1)."""
    live = peak = 0.0
    for kind, _, s in order:
        w = weight[s] if weight else 1.0
        if kind == "F":
            live += w
            peak = max(peak, live)
        elif kind in ("B", "W"):
            live -= w
    return peak


def render(timeline: Timeline, scale: float = 1.0) -> str:
    """The timeline as text, one row per rank, one cell per `scale` time units: the action's kind
    and microbatch (`F0`, `I3`, `W3`, `B1`); a lowercase kind marks a later stage of a rank holding
    two or more; `..` is idle."""
    ranks = sorted(timeline.spans)
    first = {r: min((a[2] for _, _, a in timeline.spans[r]), default=0) for r in ranks}
    cells = round(timeline.makespan / scale)
    lines = []
    for r in ranks:
        row = [".."] * cells
        for start, end, (kind, mb, s) in timeline.spans[r]:
            label = (kind if s == first[r] else kind.lower()) + str(mb)
            for c in range(round(start / scale), round(end / scale)):
                row[c] = label
        lines.append(f"rank {r} | " + " ".join(f"{c:>3}" for c in row))
    return "\n".join(lines)


def in_flight(layout: Layout, rank: int) -> float:
    """Microbatches whose activations rank `rank` holds at its peak (in units of all its layers): the
    schedule's `in_flight` (launcher/layout/schedules.py)."""
    if layout.pp == 1:
        return 1.0
    return layout.pipe.in_flight(layout.pp, layout.chunks, layout.microbatches, rank)


def logits_in_flight(layout: Layout) -> int:
    """Microbatches whose logits (and the loss's fp32 log-softmax) the last stage holds at once: the
    schedule's `logits` (launcher/layout/schedules.py)."""
    return layout.pipe.logits(layout.pp, layout.microbatches) if layout.pp > 1 else 1
