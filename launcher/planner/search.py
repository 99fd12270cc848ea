"""The layout search: enumerate the layouts the config allows, predict each, rank by tokens/s.

What is searched (a key given an int or a name in the config constrains it; `auto` searches):
- tp: divisors of the world size that divide n_heads, n_kv_heads and ffn_dim; pp: divisors of the
  rest, at most n_layers; dp: what remains; dp_shard x dp_replicate: every split of dp.
- batch.micro: divisors of the per-rank batch (global / dp) up to MAX_MICRO; the microbatch count
  follows (global / (micro dp)). Without batch.global: micro in (1, 2, 4, 8) and microbatches as
  given (None: 2 pp, or 1 without pipelining), so each layout trains its own global batch.
- pp_schedule `auto`: 1f1b, and interleaved_1f1b with virtual_stages in (2, 4, 8) when every rank
  gets a chunk and the microbatches are a multiple of pp (Megatron's rule). gpipe is only taken
  when asked for: it has 1F1B's bubble and holds all microbatches.
- recompute `auto`: the cheapest of none < selective < full that fits in memory (selective is
  skipped while attention is fused: it then frees nothing).
- sequence_parallel: as given; `explore` (the `plan` app) turns it on whenever tp > 1, where it
  always wins (the same bytes as the all-reduces it replaces, activations divided by t).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from launcher.config import ModelConfig
from launcher.flops import flops_per_token, hardware_flops_per_token, mfu
from launcher.layout import divisors
from launcher.planner.cost import StepTime, compute_efficiency, step_time
from launcher.planner.layout import GIB, Layout, Machine
from launcher.planner.memory import FUSED_ATTENTION, Memory, memory

MAX_MICRO = 32
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
RECOMPUTE = ("none", "selective", "full")
AUTO_VIRTUAL = (2, 4, 8)
DEGREES = ("tp", "pp", "dp", "dp_shard", "dp_replicate")


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    memory: Memory
    time: StepTime
    tokens_per_s: float
    mfu: float
    hfu: float  # hardware FLOPs utilisation: recomputation counted
    fits: bool
    bottleneck: str
    machine: str

    @property
    def step_time_s(self) -> float:
        return self.time.total

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "hardware": self.machine,
            "world": lay.world,
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "dp_shard": lay.dp_shard,
            "dp_replicate": lay.dp_replicate,
            "sharding": lay.sharding,
            "microbatch": lay.micro,
            "microbatches": lay.microbatches,
            "global_batch": lay.global_batch,
            "schedule": lay.schedule if lay.pp > 1 else "none",
            "virtual_stages": lay.chunks,
            "recompute": lay.recompute,
            "sequence_parallel": lay.sequence_parallel,
            "memory_gib": round(self.memory.total / GIB, 3),
            "memory": self.memory.as_gib(),
            "fits": self.fits,
            "step_time_s": self.time.total,
            "time_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bottleneck": self.bottleneck,
        }


@dataclass(frozen=True)
class Problem:
    """What is planned: a model and sequence length on `world` devices of one machine type."""

    model: ModelConfig
    seq: int
    world: int
    machine: Machine
    elem: int  # bytes per activation element (compute dtype)


@dataclass
class Space:
    """The allowed values of each searched key (None: auto)."""

    degrees: dict[str, int | None]
    micro: int | None
    global_batch: int | None
    microbatches: int | None
    schedule: str | None
    virtual_stages: int | None
    recompute: str | None
    sequence_parallel: bool | None  # None: on whenever tp > 1
    notes: list[str] = field(default_factory=list)


def bottleneck(t: StepTime, efficiency: float) -> str:
    total = t.total
    parts = {
        f"TP communication over {t.tp_level}": t.tp_comm,
        "tensor-parallel dispatch on the host": t.tp_host,
        "pipeline bubble": t.pp_bubble,
        f"DP communication over {t.dp_level}": t.dp_exposed,
        f"pipeline sends over {t.pp_level}": t.pp_p2p,
    }
    name, share = max(((k, v / total) for k, v in parts.items()), key=lambda kv: kv[1])
    if share >= 0.1:
        return f"{name} ({share:.0%} of step)"
    return f"compute ({t.compute / total:.0%} of step at {efficiency:.0%} of peak)"


def predict(problem: Problem, layout: Layout, mem: Memory | None = None) -> Prediction:
    m, mach = problem.model, problem.machine
    mem = mem or memory(m, problem.seq, layout, problem.elem, mach.kind)
    t = step_time(m, problem.seq, layout, mach, problem.elem)
    tokens_per_s = layout.global_batch * problem.seq / t.total
    per_device = tokens_per_s / layout.world
    return Prediction(
        layout=layout,
        memory=mem,
        time=t,
        tokens_per_s=tokens_per_s,
        mfu=mfu(per_device, flops_per_token(m, problem.seq), mach.peak_flops),
        hfu=mfu(per_device, hardware_flops_per_token(m, problem.seq, layout.recompute), mach.peak_flops),
        fits=mem.total <= mach.memory_bytes,
        bottleneck=bottleneck(t, compute_efficiency(mach, m, layout)),
        machine=mach.name,
    )


def _tp_ok(m: ModelConfig, tp: int) -> bool:
    return m.n_heads % tp == 0 and (m.n_kv_heads or m.n_heads) % tp == 0 and m.ffn_dim % tp == 0


def layouts(problem: Problem, space: Space) -> Iterator[tuple[Layout, tuple[str, ...]]]:
    """Every layout the space allows, with the recompute choices to try (cheapest first)."""
    m, world, deg = problem.model, problem.world, space.degrees
    rec = (
        (space.recompute,)
        if space.recompute
        else tuple(r for r in RECOMPUTE if not (r == "selective" and FUSED_ATTENTION))
    )
    for tp in divisors(world) if deg["tp"] is None else [deg["tp"]]:
        if world % tp or not _tp_ok(m, tp) or (space.sequence_parallel and tp == 1):
            continue
        sp = tp > 1 and (space.sequence_parallel is not False)
        rest = world // tp
        for pp in divisors(rest) if deg["pp"] is None else [deg["pp"]]:
            if rest % pp or pp > m.n_layers:
                continue
            dp = rest // pp
            if deg["dp"] is not None and deg["dp"] != dp:
                continue
            for shard in divisors(dp) if deg["dp_shard"] is None else [deg["dp_shard"]]:
                if dp % shard or (deg["dp_replicate"] is not None and deg["dp_replicate"] != dp // shard):
                    continue
                for micro, mb in _batches(space, dp, pp):
                    for schedule, v in _schedules(space, pp, mb, m.n_layers):
                        lay = Layout(tp, pp, shard, dp // shard, micro, mb, schedule, v, rec[0], sp)
                        yield lay, rec


def _batches(space: Space, dp: int, pp: int) -> Iterator[tuple[int, int]]:
    if space.global_batch is None:
        mb = space.microbatches or (2 * pp if pp > 1 else 1)
        for micro in [space.micro] if space.micro else [1, 2, 4, 8]:
            yield micro, mb
        return
    if space.global_batch % dp:
        return
    per_rank = space.global_batch // dp
    options = [space.micro] if space.micro else [d for d in divisors(per_rank) if d <= MAX_MICRO]
    for micro in options:
        if per_rank % micro == 0 and space.microbatches in (None, per_rank // micro):
            yield micro, per_rank // micro


def _schedules(space: Space, pp: int, mb: int, n_layers: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield (space.schedule or "1f1b"), 1
        return
    if space.schedule and space.schedule != "interleaved_1f1b":
        yield space.schedule, 1
        return
    if space.schedule is None:
        yield "1f1b", 1
    if mb % pp == 0:
        vs = [space.virtual_stages] if space.virtual_stages else AUTO_VIRTUAL
        for v in vs:
            if pp * v <= n_layers:
                yield "interleaved_1f1b", v


@dataclass
class Result:
    ranked: list[Prediction]  # fitting layouts, most tokens/s first (fastest step for a fixed batch)
    tried: int  # layouts enumerated (before recompute choices)
    smallest: Prediction | None  # the layout needing the least memory (for the error message)


def search(problem: Problem, space: Space) -> Result:
    ranked, tried, smallest, small_mem = [], 0, None, None
    cap = problem.machine.memory_bytes
    for lay, rec in layouts(problem, space):
        tried += 1
        for r in rec:
            cand = lay if r == lay.recompute else _with(lay, recompute=r)
            mem = memory(problem.model, problem.seq, cand, problem.elem, problem.machine.kind)
            if mem.total <= cap:
                ranked.append(predict(problem, cand, mem))
                break
            if small_mem is None or mem.total < small_mem.total:
                small_mem, smallest = mem, cand
    ranked.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    best_small = predict(problem, smallest, small_mem) if smallest is not None and not ranked else None
    return Result(ranked=ranked, tried=tried, smallest=best_small)


def _with(lay: Layout, **changes: Any) -> Layout:
    from dataclasses import replace

    return replace(lay, **changes)
