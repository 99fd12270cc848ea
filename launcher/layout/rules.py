"""The validity rules: what divides what, once each. `plan` skips a layout that breaks one and
`train` refuses it, both through `violations`; each rule returns one line naming the key and the
fix, or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from launcher.errors import LauncherError
from launcher.flops import ModelShape, expert_width
from launcher.layout.core import Layout, stage_layers
from launcher.layout.degrees import divisors
from launcher.layout.schedules import SCHEDULE


def _tensor_parallel(lay: Layout, m: ModelShape, seq_len: int) -> str | None:
    kv = m.n_kv_heads or m.n_heads
    split = (
        ("model.n_heads", m.n_heads, "attention heads are split over the tensor-parallel ranks"),
        ("model.n_kv_heads", kv, "KV heads are split over the tensor-parallel ranks"),
        ("model.ffn_dim", m.ffn_dim, "the MLP hidden width is split over the tensor-parallel ranks"),
        ("model.vocab_size", m.vocab_size, "the vocabulary is split over the tensor-parallel ranks"),
    )
    for key, value, what in split:
        if value % lay.tp:
            fits = ", ".join(map(str, divisors(math.gcd(*(v for _, v, _ in split)))))
            return f"tp={lay.tp} does not divide {key}={value} ({what}): use tp in {{{fits}}}"
    return None


def _sequence_parallel(lay: Layout, m: ModelShape, seq_len: int) -> str | None:
    if lay.sequence_parallel and lay.tp == 1:
        return "sequence_parallel=true needs tensor parallelism: set tp>1 or sequence_parallel=false"
    if lay.sequence_parallel and seq_len % (lay.tp * lay.cp):
        cp = f" x cp={lay.cp}" if lay.cp > 1 else ""
        return f"sequence_parallel=true shards the sequence: seq_len={seq_len} must be a multiple of tp={lay.tp}{cp}"
    return None


def _context_parallel(lay: Layout, m: ModelShape, seq_len: int) -> str | None:
    chunks = 2 * lay.cp  # rank i holds chunks i and 2cp-1-i: the same causal work on every rank
    if lay.cp > 1 and seq_len % chunks:
        fits = [c for c in divisors(seq_len // 2) if c > 1][:6] if seq_len % 2 == 0 else []
        choice = f"cp in {{{', '.join(map(str, fits))}}}" if fits else "an even seq_len"
        return (
            f"cp={lay.cp} splits each sequence into 2 x cp = {chunks} equal chunks: seq_len={seq_len} is not a "
            f"multiple of {chunks}: use seq_len={(seq_len // chunks + 1) * chunks} or {choice}"
        )
    return None


def _stages(lay: Layout, m: ModelShape, seq_len: int) -> str | None:
    if lay.pp == 1 and (lay.schedule != "1f1b" or lay.virtual_stages > 1):  # pipeline-only keys, no pipeline
        key = "pp_schedule" if lay.schedule != "1f1b" else "virtual_stages"
        value = lay.schedule if key == "pp_schedule" else lay.virtual_stages
        return f"{key}={value} schedules pipeline stages, and pp=1 has none: set pp=2 or more, or drop {key}"
    row = lay.pipe
    if lay.virtual_stages > 1 and not row.multi_stage:
        interleaved = " or ".join(s.name for s in SCHEDULE.values() if s.interleaved)
        return f"virtual_stages={lay.virtual_stages} needs pp_schedule={interleaved} (got {lay.schedule})"
    if lay.pp > 1 and row.v_shape and lay.virtual_stages != 2:
        return f"pp_schedule={lay.schedule} holds exactly 2 stages per rank (a V): set virtual_stages=2"
    stages = lay.pp * lay.virtual_stages
    if stages > m.n_layers and row.v_shape:
        return (
            f"pp_schedule={lay.schedule} needs 2 x pp = {stages} stages, more than model.n_layers={m.n_layers}: "
            f"use pp <= {m.n_layers // 2} or pp_schedule=1f1b"
        )
    if stages > m.n_layers:
        return (
            f"pp x virtual_stages = {lay.pp} x {lay.virtual_stages} = {stages} stages exceed "
            f"model.n_layers={m.n_layers}: use at most {m.n_layers} stages (uneven splits are fine)"
        )
    if lay.v_shape and m.tied_embeddings:
        return (
            f"model.tied_embeddings=true with pp_schedule={lay.schedule}: rank 0 would hold the embedding and its "
            "last-stage copy as two parameters a checkpoint cannot name as one; use pp_schedule=interleaved_zb "
            "or 1f1b, or model.tied_embeddings=false"
        )
    return None


def _microbatches(lay: Layout, m: ModelShape, seq_len: int) -> str | None:
    if lay.pp == 1:
        return None
    if lay.microbatches < lay.pp:
        return (
            f"{lay.microbatches} microbatches per step cannot fill pp={lay.pp} stages: set microbatches "
            f"(or batch.global / (batch.micro x dp)) to at least {lay.pp}"
        )
    row = lay.pipe
    if row.rounds and lay.microbatches % lay.pp:
        return (
            f"microbatches={lay.microbatches} is not a multiple of pp={lay.pp} ({lay.schedule}): "
            f"use {(lay.microbatches // lay.pp + 1) * lay.pp}"
        )
    if lay.microbatches < row.fill * lay.pp:
        least = row.fill * lay.pp
        return (
            f"{lay.microbatches} microbatches per step cannot fill the {row.fill} x pp = {least} stages of "
            f"{lay.schedule}: set microbatches (or batch.global / (batch.micro x dp)) to at least {least}"
        )
    return None


def _recompute(lay: Layout, m: ModelShape, seq_len: int) -> str | None:
    if lay.recompute_layers == 0:
        return None
    if lay.recompute == "full":
        return (
            f"recompute_layers={lay.recompute_layers} with recompute=full: every block is recomputed already; "
            "set recompute_layers=0 or recompute=none|selective"
        )
    smallest = min(len(s) for s in stage_layers(m.n_layers, lay.stages))
    if lay.recompute_layers > smallest:
        return (
            f"recompute_layers={lay.recompute_layers} exceeds the {smallest} blocks of the smallest pipeline stage "
            f"(model.n_layers={m.n_layers} over {lay.stages} stages): use at most {smallest}, or recompute=full"
        )
    return None


def expert_split(ep: int, m: ModelShape) -> str | None:
    """ep against the model's routed experts: the rule `plan` and `train` apply to a layout, and
    `validate.check_moe` to the config's ep before any layout exists (one wording for both)."""
    if ep > 1 and not m.moe.experts:
        return f"ep={ep} needs a mixture-of-experts model: set ep=1 or model.moe.experts>0"
    if m.moe.experts % ep:
        return f"ep={ep} does not divide model.moe.experts={m.moe.experts}: use an ep that divides it"
    return None


def _expert_parallel(lay: Layout, m: ModelShape, seq_len: int) -> str | None:
    problem = expert_split(lay.ep, m)
    if problem:
        return problem
    if lay.dp_shard % lay.ep:
        return (
            f"ep={lay.ep} does not divide dp_shard={lay.dp_shard} (expert parallelism is carved from the "
            f"data-parallel ranks that shard): raise dp_shard or lower ep"
        )
    shared = m.moe.shared_experts * expert_width(m) if m.moe.experts else 0
    if shared % lay.tp:
        return f"tp={lay.tp} does not divide the shared experts' width {shared} (split like the MLP): change tp"
    if lay.ep > 1 and lay.cp > 1:
        return f"ep={lay.ep} with cp={lay.cp} is not supported yet: set ep=1 or cp=1"
    return None


Rule = Callable[[Layout, ModelShape, int], str | None]
RULES: tuple[Rule, ...] = (
    _tensor_parallel,
    _context_parallel,
    _sequence_parallel,
    _stages,
    _microbatches,
    _recompute,
    _expert_parallel,
)


def violations(lay: Layout, m: ModelShape, seq_len: int) -> Iterator[str]:
    """What is wrong with `lay` for this model and sequence length: one line each, naming the key
    and the fix. `plan` skips such layouts, `train` refuses them, both through this."""
    for rule in RULES:
        problem = rule(lay, m, seq_len)
        if problem:
            yield problem


def check(lay: Layout, m: ModelShape, seq_len: int) -> None:
    """`train`'s refusal: the first violation, as a LauncherError."""
    problem = next(violations(lay, m, seq_len), None)
    if problem:
        raise LauncherError(problem)


def async_tp_applies(layout: Layout, async_tp: bool) -> bool:
    """Whether torch's async TP overlaps this layout's TP collectives (`async_tp`: asked for, and the
    config checks passed: cuda, compile, sequence parallelism): with TP, and blocks that are compiled
    (zero-bubble schedules leave them eager; parallel/compiled.py `compile_blocks`)."""
    return async_tp and layout.tp > 1 and layout.sequence_parallel and not layout.zero_bubble
