"""The layout search: enumerate the layouts the config allows, predict each, rank by tokens/s.

What is searched (a key given an int or a name in the config constrains it; `auto` searches):
- tp: divisors of the world size; cp (when `auto`): powers of two up to MAX_AUTO_CP that leave each
  rank at least MIN_CP_TOKENS of a sequence; pp: divisors of the rest; dp: what remains; dp_shard x
  dp_replicate: every split of dp (what one fixes, the other fills).
- batch.micro: divisors of the per-rank batch (global / dp) up to MAX_MICRO. Without batch.global:
  micro in (1, 2, 4, 8), so each layout trains its own global batch. The microbatch count follows
  from the runtime's rule (`layout.microbatch_count`).
- pp_schedule `auto`: every schedule whose row says `auto` (launcher/layout/schedules.py: all but
  gpipe), each with the virtual stages its row tries (`virtual_tries`) unless virtual_stages is given.
Every candidate then passes the runtime's own rules (`layout.violations`: tp divides the model,
stages fit the layers, microbatches fill the pipeline, ...) or is skipped; the first rule broken is
kept for the error when nothing is valid.
- recompute and recompute_layers `auto`: no recompute if it fits; else, for each policy (none,
  selective), the smallest recompute_layers N (blocks per stage recomputed in full) that fits, and
  of those the faster; full recompute only when neither fits with every block of a stage recomputed.
- fsdp.reshard_after_forward: as given; `explore` tries ZeRO-3 (always) and ZeRO-2 (never) wherever
  FSDP shards without pipelining (with pipelining `auto` already keeps the stage gathered).
- ep (mixture of experts): divisors of dp_shard that divide the routed experts.
- sequence_parallel: as given; `explore` (the `plan` app) turns it on whenever tp > 1, where it
  always wins (the same bytes as the all-reduces it replaces, activations divided by t).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from heapq import heappush, heappushpop

from launcher.config.model import ModelConfig
from launcher.errors import LauncherError
from launcher.layout import (
    SCHEDULE,
    Layout,
    divisors,
    microbatch_count,
    split_dp,
    violations,
)
from launcher.planner.memo import private_model
from launcher.planner.memory import Memory, chunked_loss
from launcher.planner.predict import Prediction, Problem, predict, problem_memory, speed_bound

MAX_MICRO = 32
# Context parallelism is for long sequences: Llama 3's 128K stage ran cp=16, 8K tokens per rank.
# Shorter local shares leave each rank's kernels little work, which the efficiency model does not
# see; the bound also keeps the search fast (`plan` for 405b on 16,384 devices in under 1 s).
MIN_CP_TOKENS = 4096
MAX_AUTO_CP = 32
# a candidate before its reshard choice: Layout's first ten fields (tp, pp, dp_replicate, dp_shard, micro,
# microbatches, schedule, virtual_stages, recompute, sequence_parallel), then cp and ep
Point = tuple[int, int, int, int, int, int, str, int, str, bool, int, int]
PRUNE_MARGIN = 1e-9  # relative: memory totals that differ by rounding alone are not pruned on


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
    recompute_layers: int | None = 0
    reshard: str | None = "auto"  # None: always and never where FSDP runs without pipelining


def candidates(problem: Problem, space: Space) -> Iterator[Layout | str]:
    """Every layout the space allows, or for one that breaks a rule, the rule's message."""
    for point in _points(problem, space):
        yield point if isinstance(point, str) else _layout(point)


def _layout(point: Point, reshard: str = "auto") -> Layout:
    return Layout(*point[:10], 0, reshard, *point[10:])


def _points(problem: Problem, space: Space) -> Iterator[Point | str]:
    """`candidates` as `Point`s (the search builds a layout only for those it evaluates). Parts of a layout
    are checked as soon as they are chosen (the fields not chosen yet at neutral values), so a tp that does
    not divide the model is not expanded into thousands of candidates."""
    m, seq, world, deg = problem.model, problem.seq, problem.world, space.degrees
    for tp in [deg["tp"]] if deg["tp"] else divisors(world):
        sp = space.sequence_parallel if space.sequence_parallel is not None else tp > 1
        if broken := _first(Layout(tp=tp, sequence_parallel=sp), m, seq):
            yield broken
            continue
        for cp in [deg["cp"]] if deg["cp"] else _cp_options(world // tp, seq):
            if broken := _first(Layout(tp=tp, cp=cp, sequence_parallel=sp), m, seq):
                yield broken
                continue
            yield from _inner(problem, space, tp, cp, sp)


def _cp_options(ranks: int, seq: int) -> list[int]:
    """cp values `auto` tries: powers of two dividing `ranks`, each rank keeping MIN_CP_TOKENS."""
    options = [1]
    while (
        options[-1] * 2 <= MAX_AUTO_CP and ranks % (options[-1] * 2) == 0 and seq // (options[-1] * 2) >= MIN_CP_TOKENS
    ):
        options.append(options[-1] * 2)
    return options


def _inner(problem: Problem, space: Space, tp: int, cp: int, sp: bool) -> Iterator[Point | str]:
    """The candidates of one (tp, cp): pp, the dp split, micro and the schedule. The rules are checked once
    for every micro-batch size: none reads it (tests/unit/test_planner_speed.py)."""
    m, seq, deg = problem.model, problem.seq, space.degrees
    rest, checked, rec = problem.world // (tp * cp), {}, space.recompute or "none"
    for pp in [deg["pp"]] if deg["pp"] else divisors(rest):
        dp = rest // pp
        if rest % pp or (deg["dp"] and deg["dp"] != dp):
            continue
        if broken := _first(Layout(tp=tp, pp=pp, microbatches=pp, sequence_parallel=sp, cp=cp), m, seq):
            yield broken
            continue
        schedules, micros = list(_schedules(space, pp)), _micro_options(space, dp)
        for replicate, shard in _dp_splits(dp, deg["dp_shard"], deg["dp_replicate"]):
            eps = _ep_options(m, deg["ep"], shard)
            for micro in micros:
                try:
                    count = microbatch_count(micro, dp, pp, space.global_batch, space.microbatches)
                except LauncherError as err:
                    yield str(err)
                    continue
                for schedule, v in schedules:
                    for ep in eps:
                        point = (tp, pp, replicate, shard, micro, count, schedule, v, rec, sp, cp, ep)
                        if (rules := (pp, replicate, shard, count, schedule, v, ep)) not in checked:
                            checked[rules] = _first(_layout(point), m, seq)
                        yield checked[rules] or point


def _ep_options(m: ModelConfig, ep: int | None, shard: int) -> list[int]:
    """ep as given, else every degree dividing both the experts and dp_shard (1 for a dense model)."""
    if ep:
        return [ep]
    return [e for e in divisors(shard) if m.moe.experts % e == 0] if m.moe.experts else [1]


def _variant(lay: Layout, **changes: object) -> Layout:
    """`dataclasses.replace` at a third of its cost (it reads every field's metadata first): the search makes
    a layout for each recompute choice it probes."""
    return Layout(**{**vars(lay), **changes})


def _first(lay: Layout, m: ModelConfig, seq: int) -> str | None:
    return next(violations(lay, m, seq), None)


def _dp_splits(dp: int, shard: int | None, replicate: int | None) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) pairs: all splits of dp when both are auto, else the one they fix."""
    if shard is None and replicate is None:
        return [(dp // s, s) for s in divisors(dp)]
    try:
        return [split_dp(dp, shard, replicate)]
    except LauncherError:
        return []


def _micro_options(space: Space, dp: int) -> list[int]:
    if space.micro:
        return [space.micro]
    if space.global_batch is None:
        return [1, 2, 4, 8]
    if space.global_batch % dp:
        return [1]  # microbatch_count says why it does not split
    return [d for d in divisors(space.global_batch // dp) if d <= MAX_MICRO]


def _schedules(space: Space, pp: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield space.schedule or "1f1b", space.virtual_stages or 1
        return
    for row in [SCHEDULE[space.schedule]] if space.schedule else [r for r in SCHEDULE.values() if r.auto]:
        if space.virtual_stages and not row.v_shape:  # given (a fixed row's rule refuses a wrong count)
            yield row.name, space.virtual_stages
        else:
            yield from ((row.name, v) for v in row.virtual_tries())


@dataclass
class Result:
    ranked: list[Prediction]  # fitting layouts, most tokens/s first (fastest step for a fixed batch); the first `top`
    tried: int  # valid layouts enumerated, each reshard choice apart (before recompute choices)
    smallest: Prediction | None  # the layout needing the least memory (for the error message)
    broken: str | None  # the first rule a candidate broke (for the error when none is valid)
    fit: int = 0  # the layouts that fit (len(ranked) unless `top` cut it)


def search(problem: Problem, space: Space, top: int = 0) -> Result:
    """Every layout `space` allows, ranked; `top` > 0: only the first `top` of them (the others are counted,
    not predicted, where `speed_bound` shows they cannot reach the top)."""
    res = _search(problem, space, prune=True, top=top)
    if res.ranked or not res.tried:
        return res
    # nothing fits: the layout needing the least memory (for the error) over every choice, as the
    # unpruned search tries them
    return _search(problem, space, prune=False)


def _search(problem: Problem, space: Space, prune: bool, top: int = 0) -> Result:
    problem = replace(problem, model=private_model(problem.model))
    ranked, tried, smallest, small_mem = [], 0, None, None
    broken, fit, fastest = None, 0, []  # fastest: a heap of the `top` most tokens/s so far (prune and top)
    exhausted: dict[tuple[object, ...], int] = {}  # (prune) a layout but its batch split: the micro none fits from
    for point in _points(problem, space):
        if isinstance(point, str):
            broken = broken or point
            continue
        tp, pp, replicate, shard, micro, _, schedule, v, _, _, cp, ep = point
        for reshard in _reshards(space, shard, pp):
            tried += 1  # each reshard choice a layout of its own, as `ranked` counts them
            key = (tp, pp, cp, replicate, shard, ep, schedule, v, reshard)  # but the batch split and recompute
            if prune and micro >= exhausted.get(key, micro + 1):
                continue
            cand = _layout(point, reshard)
            floor = fastest[0] if len(fastest) == top > 0 else 0.0  # the top's slowest: none slower joins it
            best, fits, least = _fitting(problem, space, cand, prune, floor)
            fit += fits
            if best is not None:
                ranked.append(best)
                if prune and top:
                    (heappushpop if len(fastest) == top else heappush)(fastest, best.tokens_per_s)
            if prune and not fits and (start := _none_fit_from(problem, cand, least[1])) is not None:
                exhausted[key] = min(start, exhausted.get(key, start))
            elif not prune and not fits and (small_mem is None or least[1].total < small_mem.total):
                smallest, small_mem = least
    ranked.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    best_small = predict(problem, smallest, small_mem) if smallest is not None and not ranked else None
    return Result(ranked=ranked[:top] if top else ranked, tried=tried, smallest=best_small, broken=broken, fit=fit)


def _none_fit_from(problem: Problem, lay: Layout, least: Memory) -> int | None:
    """The smallest micro-batch from which no layout like `lay` but for its batch split and recompute
    choice fits, as far as `least` (the least memory `lay`'s choices need, none fitting) tells: any,
    where the weights alone overflow; from lay's micro up, with a margin for rounding, where the logits
    are whole (activations and logits grow with micro x the microbatches in flight, which no schedule
    lets fall as micro grows; the chunked loss's chunk can shrink)."""
    cap = problem.machine.memory_bytes
    if _state(least) > cap:
        return 0
    return lay.micro if not chunked_loss(lay) and least.total > cap * (1 + PRUNE_MARGIN) else None


def _state(mem: Memory) -> float:
    """What a device holds whatever the batch split and recompute: weights, optimizer state, working
    copies, the fixed overhead (gradients apart: the embedding's whole-table gradient is sized against
    the activations)."""
    return mem.params + mem.optimizer + mem.buffers + mem.overhead


def _reshards(space: Space, shard: int, pp: int) -> tuple[str, ...]:
    if space.reshard is not None:
        return (space.reshard,)
    return ("always", "never") if shard > 1 and pp == 1 else ("auto",)


def _fitting(
    problem: Problem, space: Space, lay: Layout, prune: bool = False, floor: float = 0.0
) -> tuple[Prediction | None, bool, tuple[Layout, Memory]]:
    """`lay`'s recompute choice that fits, if any, whether one fits, and the least-memory choice tried (for
    the error when nothing fits; `prune`: of every choice probed). The order is none < selective < full;
    with recompute_layers auto, each of none and selective takes the smallest N that fits, the faster wins.
    `prune`: skip the choices that cannot fit (`_left`). A choice whose `speed_bound` is under `floor` is not
    predicted: where none is left, the choice is None (the layout still fits)."""
    m, cap, fixed = problem.model, problem.machine.memory_bytes, space.recompute_layers
    most = m.n_layers // lay.stages  # the smallest stage's blocks (layout.stage_layers)
    fits: list[Prediction | None] = []
    least: tuple[Layout, Memory] | None = None
    tried: dict[tuple[str, int], tuple[Layout, Memory]] = {}

    def mem(recompute: str, layers: int) -> tuple[Layout, Memory]:
        if (recompute, layers) not in tried:
            same = (lay.recompute, lay.recompute_layers) == (recompute, layers)
            cand = lay if same else _variant(lay, recompute=recompute, recompute_layers=layers)
            tried[recompute, layers] = cand, problem_memory(problem, cand)
        return tried[recompute, layers]

    policies = [space.recompute] if space.recompute else ["none", "selective", "full"]
    if prune and not space.recompute and fixed is None and (left := _left(mem, cap)) is not None:
        policies, fixed = left, 0
    for policy in policies:
        if policy == "full" and (fits or fixed):  # full only when nothing else fits
            break
        searched = fixed is None and policy != "full"
        n = _smallest_fitting(lambda k, p=policy: mem(p, k)[1].total <= cap, most) if searched else fixed or 0
        cand, used = mem(policy, most if n is None else n)
        if least is None or used.total < least[1].total:
            least = (cand, used)
        if n is not None and used.total <= cap:
            fits.append(predict(problem, cand, used) if not floor or speed_bound(problem, cand) >= floor else None)
            if not searched or n == 0:
                break  # the first that fits in the order, or nothing recomputed: nothing is faster
    if prune:  # the least of every probe: what `_none_fit_from` reads
        least = min(tried.values(), key=lambda c: c[1].total)
    assert least is not None
    scored = [p for p in fits if p is not None]  # any left outscores those not predicted: bound < floor <= it
    return (max(scored, key=lambda p: p.tokens_per_s) if scored else None), bool(fits), least


def _left(mem: Callable[[str, int], tuple[Layout, Memory]], cap: float) -> list[str] | None:
    """The policies left to try, with N = 0, where nothing recomputed does not fit: none where the weights
    alone overflow; selective where full recompute does not fit either (with a margin for rounding), as
    recomputing N >= 1 blocks of a stage in full keeps at least what full recompute keeps of every block
    and the working set of the one rebuilt, as full recompute does; None (all) otherwise."""
    nothing = mem("none", 0)[1]
    if nothing.total <= cap:
        return None
    if _state(nothing) > cap:
        return []
    return ["selective"] if mem("full", 0)[1].total > cap * (1 + PRUNE_MARGIN) else None


def _smallest_fitting(fits: Callable[[int], bool], most: int) -> int | None:
    """The smallest n in 0..most with fits(n); None if none. From n = 1 on memory falls as n grows
    (bisection); n = 0 is tried alone, as rebuilding one block in backward costs its working set."""
    if fits(0):
        return 0
    if most == 0 or not fits(most):
        return None
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
