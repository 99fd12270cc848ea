"""What keeps `plan` fast (`python -m bench planner_speed` times it) changes no prediction: the memoised
per-stage terms read no layout field but those they are keyed on, and the pruned search ranks exactly
the layouts, in exactly the order, the exhaustive one does."""

from __future__ import annotations

import dataclasses
import random
import sys
from collections import defaultdict
from operator import attrgetter
from typing import Any

import pytest

from bench.published_runs import make_cfg
from launcher.layout import SCHEDULE, SCHEDULES, Layout, violations
from launcher.planner import memo, memory
from launcher.planner.predict import predict
from launcher.planner.request import problem, space

search = sys.modules["launcher.planner.search"]  # the module: `launcher.planner.search` names the function
AUTO = dict(tp="auto", pp="auto", cp="auto", pp_schedule="auto", recompute="auto", recompute_layers="auto")


def random_layouts(count: int, seed: int = 0) -> list[Layout]:
    """Layouts varying every field (validity aside: the memoised terms are arithmetic on them)."""
    rng = random.Random(seed)
    choices = dict(
        tp=(1, 2, 4), pp=(1, 2, 4), dp_replicate=(1, 2), dp_shard=(1, 2, 4), micro=(1, 2), microbatches=(4, 8),
        schedule=SCHEDULES, virtual_stages=(1, 2), recompute=("none", "selective", "full"),
        sequence_parallel=(False, True), recompute_layers=(0, 1, 3), reshard=("always", "never", "auto"),
        cp=(1, 2), ep=(1, 2),
    )  # fmt: skip
    layouts = [Layout(**{k: rng.choice(v) for k, v in choices.items()}) for _ in range(count)]
    layouts = [dataclasses.replace(lay, ep=1) if lay.dp_shard % lay.ep else lay for lay in layouts]  # ep in dp_shard
    return [dataclasses.replace(lay, virtual_stages=2) if SCHEDULE[lay.schedule].v_shape else lay for lay in layouts]


def calls(fn: Any, m: Any, machine: Any, lay: Layout) -> list[tuple[tuple[Any, ...], Any]]:
    """(the arguments but the layout, the value) of `fn` on `lay`, for every rank where it takes one."""

    def timed(r: int) -> tuple[Any, ...]:  # step_time's arguments after the layout: async TP, compiled and not
        return machine, 2, r == 0, True, r == 1, None, 0.0

    per_rank = {
        "rank_params": lambda r: (m, lay, r),
        "ranks_full": lambda r: (m.n_layers, lay),
        "layer_activation_bytes": lambda r: (m, 4096, lay, 2, r == 0),  # fused attention and not
        "rank_work": lambda r: (m, 4096, lay, machine),
        "ends_saved": lambda r: (m, 4096, lay, 2, r == 0, 4 if r else 2),  # the stream: autocast or not
        "ends_state": lambda r: (m, 4096, lay, 2, "cpu" if r == 0 else "cuda"),  # cpu: cp's causal masks
        "microbatch_time": lambda r: (m, 4096, lay, *timed(r)),
        "lower_bound": lambda r: (m, 4096, lay, *timed(r)),
    }[fn.__name__]
    out = []
    for r in range(lay.pp):
        args = per_rank(r)
        out.append(((*[a for a in args if a is not lay],), fn.__wrapped__(*args)))
    return out


def test_every_memoised_term_reads_only_the_fields_it_is_keyed_on():
    """Layouts equal in a memoised function's fields (its key) give it equal values, on a dense model and
    a mixture of experts with leading dense layers."""
    assert {f.__name__ for f in memo.MEMOISED} >= {
        "rank_params",
        "ranks_full",
        "rank_work",
        "ends_state",
        "ends_saved",
        "microbatch_time",
        "lower_bound",
    }
    for name in ("8b", "dsv3_like"):
        cfg = make_cfg(name, "h100_sxm")
        m, machine = cfg.model, problem(cfg, 8).machine
        for fn in memo.MEMOISED:
            seen: dict[tuple[Any, ...], Any] = {}
            for lay in random_layouts(400):
                for args, value in calls(fn, m, machine, lay):
                    key = (attrgetter(*fn.fields)(lay), args)
                    assert seen.setdefault(key, value) == value, (fn.__name__, lay)


def unmemoised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every planner module calls the memoised functions' own bodies."""
    wrapped = {id(f): f.__wrapped__ for f in memo.MEMOISED}
    for mod in [m for n, m in sys.modules.items() if n.startswith("launcher.planner")]:
        for attr, value in list(vars(mod).items()):
            if id(value) in wrapped:
                monkeypatch.setattr(mod, attr, wrapped[id(value)])


CASES = [  # model, hardware, world, seq_len, batch.global: tight and roomy memory, MoE, long sequences
    ("8b", "h100_sxm", 8, 4096, None),
    ("8b", "a100", 16, 8192, 64),
    ("70b", "h100_sxm", 32, 4096, 64),
    ("70b", "h100_sxm", 64, 16384, 32),
    ("1b", "tpu_v5p", 16, 2048, None),
    ("mixtral_8x7b", "h100_sxm", 32, 4096, 128),
    ("dsv3_like", "h100_sxm", 16, 2048, None),
]


@pytest.mark.slow  # ~5 s: the exhaustive search without memoised terms
def test_the_pruned_search_ranks_what_the_exhaustive_one_does(monkeypatch):
    """Every layout that fits, its recompute choice, its prediction and its rank, with and without the
    pruning (`_hopeless`, and the state overflow that skips a layout's other batch splits) and the
    memoised terms; and the pruning evaluates fewer memories."""
    evaluated: dict[bool, int] = defaultdict(int)
    original = search.problem_memory

    def counted(prune: bool) -> Any:
        def problem_memory(*args: Any) -> Any:
            evaluated[prune] += 1
            return original(*args)

        return problem_memory

    results: dict[bool, list[Any]] = defaultdict(list)
    for prune in (True, False):
        with monkeypatch.context() as patch:
            if not prune:
                unmemoised(patch)
            patch.setattr(search, "problem_memory", counted(prune))
            for model, hardware, world, seq, glob in CASES:
                res = search._search(*planned(model, hardware, world, seq, glob), prune)
                results[prune].append((res.tried, res.fit, [p.as_dict() for p in res.ranked]))
    for case, pruned, exhaustive in zip(CASES, results[True], results[False], strict=True):
        assert pruned == exhaustive and exhaustive[1] == len(exhaustive[2]), case
        for top in (1, 5):  # what `plan` shows: the best `top`, the others counted, not predicted
            res = search.search(*planned(*case), top)
            assert (res.tried, res.fit, [p.as_dict() for p in res.ranked]) == (*exhaustive[:2], exhaustive[2][:top])
    assert any(ranked for _, _, ranked in results[True])
    assert evaluated[True] < 0.7 * evaluated[False], dict(evaluated)


def planned(model: str, hardware: str, world: int, seq: int, glob: int | None) -> tuple[Any, Any]:
    cfg = make_cfg(model, hardware, seq_len=seq, batch={"micro": "auto", "global": glob}, **AUTO)
    cfg = dataclasses.replace(cfg, nodes=max(1, world // cfg.hardware.devices_per_node))
    return problem(cfg, world), space(cfg, world, True)


def test_the_best_few_are_predicted_the_rest_only_counted(monkeypatch):
    """`plan` with plan.top ranks the first `top` layouts of the full ranking, counts every layout that fits,
    and predicts fewer: those whose `speed_bound` falls under the top's slowest are not."""
    predicted = []
    monkeypatch.setattr(search, "predict", lambda *args: predicted.append(args) or predict(*args))
    prob, allowed = planned("8b", "h100_sxm", 16, 4096, None)
    every = search.search(prob, allowed)
    counted = len(predicted)
    best = search.search(prob, allowed, 3)
    assert [p.as_dict() for p in best.ranked] == [p.as_dict() for p in every.ranked[:3]]
    assert (best.fit, best.tried) == (len(every.ranked), every.tried) and best.fit > 3
    assert len(predicted) - counted < counted / 2, (len(predicted) - counted, counted)
    assert all(search.speed_bound(prob, p.layout) >= p.tokens_per_s for p in every.ranked)  # a bound


def test_no_layout_rule_reads_the_micro_batch_size():
    """The search checks a layout's rules once for all its micro-batch sizes (`_inner`), and makes its
    probes' layouts as dataclasses.replace does (`_variant`)."""
    m = make_cfg("dsv3_like").model
    for lay in random_layouts(300, seed=1):
        for micro in (1, 3, 8):
            other = dataclasses.replace(lay, micro=micro)
            assert list(violations(lay, m, 4096)) == list(violations(other, m, 4096)), lay
            assert search._variant(lay, micro=micro, recompute="full") == dataclasses.replace(other, recompute="full")


def test_nothing_fits_names_the_smallest_layout_as_the_exhaustive_search_does():
    """The error's smallest layout comes from every choice (the search reruns unpruned)."""
    cfg = make_cfg("405b", "h100_sxm", seq_len=8192, batch={"micro": "auto", "global": 64}, **AUTO)
    prob, allowed = problem(cfg, 8), space(cfg, 8, True)
    res = search.search(prob, allowed)
    assert not res.ranked and res.smallest is not None
    assert res.smallest == search._search(prob, allowed, prune=False).smallest
    assert search._search(prob, allowed, prune=True).smallest is None  # the pruned search does not track it


def test_memoised_terms_start_over_past_their_bound(monkeypatch):
    """A long-lived process (a sweep, the tests) keeps at most MAX_ENTRIES per function, values unchanged."""
    monkeypatch.setattr(memo, "MAX_ENTRIES", 2)
    pps = (1, 2, 4, 1, 2, 4)
    assert [memory.full_layers(32, Layout(pp=p, recompute="full"), 0) for p in pps] == [32, 16, 8, 32, 16, 8]
