"""The one Layout, and every rule about layouts, once each.

`Layout` is a run's resolved parallel layout: the degrees, the batch split, the pipeline schedule,
recompute and sequence parallelism. `planner.resolve` builds it once (the CLI's only call into the
planner); the planner scores candidates built with the same rules; parallelize, the loop, the dry
run and SLURM read it and never re-derive anything from the raw config. No torch at module level:
`plan` imports this on accelerator profiles.

Batch semantics (docs/parallelism.md): `micro` sequences per microbatch per data-parallel rank,
`microbatches` per step per data-parallel rank (pipeline microbatches, or gradient-accumulation
steps without pipelining), so a step trains `micro x microbatches x dp` sequences (`batch.global`).

Ranks are ordered tp innermost (a tensor-parallel group sits inside the fastest link domain), then
context parallel, then data parallel (replicate outer, shard inner), then pipeline outermost:
    rank = tp_rank + tp * (cp_rank + cp * (dp_shard_rank + dp_shard * (dp_replicate_rank + dp_replicate * pp_rank)))
Context-parallel ranks see the same sequences (each its chunks of them) and hold identical weights:
FSDP shards over dp_shard x cp together, as torchtitan does (launcher/parallel/context.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from launcher.config import LauncherError, ModelConfig, TrainConfig
from launcher.flops import expert_width

MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")  # schedules with virtual stages
V_SHAPED = ("zbv", "dualpipev")  # exactly two stages per rank, in a V: rank r holds r and 2 pp - 1 - r
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")  # backward split into input and weight gradients
DEGREES = ("tp", "pp", "cp", "dp", "dp_shard", "dp_replicate", "ep")  # the config keys of the parallel degrees
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first: the rank order above


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1  # DDP degree (HSDP when both dp degrees > 1)
    dp_shard: int = 1  # FSDP degree (1: parameters replicated)
    micro: int = 1  # sequences per microbatch per data-parallel rank
    microbatches: int = 1  # per step per dp rank: pipeline microbatches, or accumulation steps
    schedule: str = "1f1b"  # pipeline schedule (config.SCHEDULES), read when pp > 1
    virtual_stages: int = 1  # model chunks per pipeline rank (MULTI_STAGE schedules; V_SHAPED: 2)
    recompute: str = "none"  # config.RECOMPUTE: the policy of every block not in recompute_layers
    sequence_parallel: bool = False
    recompute_layers: int = 0  # blocks of each stage (model chunk) recomputed in full, the first ones
    reshard: str = "auto"  # fsdp.reshard_after_forward: always (ZeRO-3) | never (ZeRO-2) | auto (by stage)
    cp: int = 1  # context parallel: each sequence split over cp ranks (launcher/parallel/context.py)
    # expert parallel: routed experts split over ep ranks carved from dp_shard (as torchtitan does);
    # the other parameters stay FSDP-sharded over all of dp_shard (`expert_mesh`)
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (ep > 1), which FSDP-shards them: dp_shard / ep."""
        return self.dp_shard // self.ep

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards a parameter over: dp_shard x cp (context-parallel ranks hold the same
        weights; with cp > 1 FSDP replaces DDP over them, as in torchtitan)."""
        return self.dp_shard * self.cp

    @property
    def local_batch(self) -> int:
        """Sequences per step on one data-parallel rank."""
        return self.micro * self.microbatches

    @property
    def global_batch(self) -> int:
        """Sequences per step over all ranks (`batch.global`)."""
        return self.local_batch * self.dp

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp x virtual stages (1 without pipelining)."""
        return self.pp * self.chunks

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: the virtual stages when pipelined, else 1."""
        return self.virtual_stages if self.pp > 1 else 1

    @property
    def v_shape(self) -> bool:
        """Stages placed in a V (zbv, dualpipev): the first and the last stage share pipeline rank 0."""
        return self.pp > 1 and self.schedule in V_SHAPED

    @property
    def zero_bubble(self) -> bool:
        return self.pp > 1 and self.schedule in ZERO_BUBBLE

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last stage (the output projection and the loss)."""
        return 0 if self.v_shape else self.pp - 1

    def pp_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds (`rank_stages` with this layout's placement)."""
        return rank_stages(pp_rank, self.pp, self.chunks, self.v_shape)

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP frees gathered parameters after forward (ZeRO-3) or keeps them for backward (ZeRO-2);
        auto: torchtitan's default, ZeRO-3 without pipelining (where every microbatch would re-gather
        a resharded stage), ZeRO-2 with it."""
        return self.reshard == "always" or (self.reshard == "auto" and self.pp == 1)

    def full_layers(self, stage_size: int) -> int:
        """Blocks of a stage of `stage_size` blocks that keep only their input (full recompute)."""
        return stage_size if self.recompute == "full" else min(self.recompute_layers, stage_size)

    @property
    def sharding(self) -> str:
        if self.fsdp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "none"

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's position along each mesh dimension (the inverse of the order above)."""
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        shard, rest = rest % self.dp_shard, rest // self.dp_shard
        replicate, pp_rank = rest % self.dp_replicate, rest // self.dp_replicate
        return {
            "pp": pp_rank,
            "dp_replicate": replicate,
            "dp_shard": shard,
            "cp": cp_rank,
            "tp": tp_rank,
            "dp": replicate * self.dp_shard + shard,
            "dp_shard_cp": shard * self.cp + cp_rank,  # FSDP's flattened dimension (build_mesh)
            "ep": shard % self.ep,  # the inner part of dp_shard (`expert_mesh`)
        }

    def settings(self) -> dict[str, Any]:
        """The config keys that pin this layout (an emitted job script, a sweep point's overrides)."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "dp": self.dp,
            "dp_shard": self.dp_shard,
            "dp_replicate": self.dp_replicate,
            "batch.micro": self.micro,
            "microbatches": self.microbatches,
            "pp_schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "recompute": self.recompute,
            "recompute_layers": self.recompute_layers,
            "sequence_parallel": self.sequence_parallel,
            "fsdp.reshard_after_forward": self.reshard,
            "ep": self.ep,
        }


# --- parsing and counting ------------------------------------------------------------------------------
def int_or_auto(key: str, value: Any, auto: str | None = "auto") -> int | None:
    """A positive int, or None where the key says `auto` (`auto=None`: keys whose default is null)."""
    if value == auto:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LauncherError(f"{key}={value!r}: expected a positive integer or {auto or 'null'}")
    return value


def recompute_layers_of(value: Any) -> int | None:
    """`recompute_layers`: a count >= 0, or None for auto (the planner's choice)."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LauncherError(f"recompute_layers={value!r}: expected an integer >= 0 or auto")
    return value


def given_degrees(cfg: TrainConfig) -> dict[str, int | None]:
    """The parallel degrees the config fixes (None: auto)."""
    return {key: int_or_auto(key, getattr(cfg, key)) for key in DEGREES}


def divisors(n: int) -> list[int]:
    """Every divisor of `n`, ascending: the degrees a dimension of `n` ranks can be split into."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def workers_per_node(world: int, nodes: int) -> int:
    return -(-world // nodes)


def worker_threads(threads: int | None, local_workers: int) -> int:
    """Intra-op threads per worker: `threads`, else this machine's cores shared by the local workers
    (the planner predicts with the same count the workers run with)."""
    return threads or max(1, (os.cpu_count() or 1) // max(1, local_workers))


# --- world size ------------------------------------------------------------------------------------------
def local_devices(cfg: TrainConfig) -> int:
    """Devices per node to plan for: the profile's, or (cpu) as many local workers as may start."""
    hw = cfg.hardware
    return min(hw.devices_per_node, cfg.max_local_workers) if hw.kind == "cpu" else hw.devices_per_node


def plan_world_size(cfg: TrainConfig) -> int:
    """The devices `plan` (and the layout sweeper) plan for: nodes x devices per node (`nodes` is
    range-checked by config.validate first)."""
    return cfg.nodes * local_devices(cfg)


def launch_world_size(cfg: TrainConfig, env_world_size: int | None) -> int | None:
    """The world size the launch imposes, if any: the environment's (torchrun, SLURM), else
    nodes x devices_per_node on a GPU profile; None on the cpu profile (the degrees decide)."""
    if env_world_size is not None:
        return env_world_size
    if cfg.hardware.kind == "cuda":
        return cfg.nodes * cfg.hardware.devices_per_node
    return None


def check_world(world: int | None, degrees: dict[str, int | None]) -> None:
    """The world-size rule: the given tp x pp x cp x dp equals the world size, or divides it when dp
    (or another degree) is auto; dp_shard and dp_replicate divide dp."""
    given = {k: degrees[k] for k in ("tp", "pp", "cp", "dp") if degrees[k]}
    product = math.prod(given.values())
    complete = len(given) == 4
    if given.get("cp") == 1:  # the default: not worth naming
        del given["cp"]
    names, values = "*".join(given), "*".join(map(str, given.values()))
    if world is not None and complete and product != world:
        raise LauncherError(f"{names}={values}={product} does not match the world size {world}: set dp=auto")
    if world is not None and world % product:
        raise LauncherError(f"world size {world} is not divisible by {names}={values}: change {' or '.join(given)}")
    dp = degrees["dp"]
    if dp is None and world is not None and degrees["tp"] and degrees["pp"] and degrees["cp"]:
        dp = world // (degrees["tp"] * degrees["pp"] * degrees["cp"])
    for key in ("dp_shard", "dp_replicate"):
        if degrees[key] and dp and dp % degrees[key]:
            raise LauncherError(f"{key}={degrees[key]} does not divide dp={dp}: set {key}=auto or change dp")


def split_dp(dp: int, shard: int | None, replicate: int | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for `dp`: what one fixes, the other fills; both auto: all FSDP."""
    if shard is None and replicate is None:
        return 1, dp
    given = f"dp_replicate={replicate or 'auto'} x dp_shard={shard or 'auto'}"
    if shard is None:
        shard = dp // replicate if dp % replicate == 0 else 0
    elif replicate is None:
        replicate = dp // shard if dp % shard == 0 else 0
    if not shard or not replicate or shard * replicate != dp:
        raise LauncherError(f"{given} must equal dp={dp}: set one of them to auto")
    return replicate, shard


def fixed_degrees(degrees: dict[str, int | None], world: int | None, ep: int = 1) -> tuple[int, int, int, int, int]:
    """(tp, pp, cp, dp_replicate, dp_shard) when tp, pp and cp are given: dp takes the ranks that
    remain (when the world size is free: ep, the fewest data-parallel ranks expert parallelism runs on)."""
    check_world(world, degrees)
    tp, pp, cp = degrees["tp"] or 1, degrees["pp"] or 1, degrees["cp"] or 1
    dp = degrees["dp"] or (world // (tp * pp * cp) if world else ep)
    return tp, pp, cp, *split_dp(dp, degrees["dp_shard"], degrees["dp_replicate"])


# --- the batch split -----------------------------------------------------------------------------------
def microbatch_count(micro: int, dp: int, pp: int, global_batch: int | None, microbatches: int | None) -> int:
    """The microbatch rule: per step and data-parallel rank, batch.global / (batch.micro x dp) when
    the global batch is given, else `microbatches`, else 2 x pp with pipelining (a bubble of at most
    a third of the step under 1F1B), else 1 (no accumulation)."""
    if global_batch is None:
        return microbatches or (2 * pp if pp > 1 else 1)
    if global_batch % (micro * dp):
        raise LauncherError(
            f"batch.global={global_batch} is not a multiple of batch.micro x dp = {micro} x {dp}: "
            f"use a multiple of {micro * dp} (e.g. {max(global_batch // (micro * dp), 1) * micro * dp})"
        )
    count = global_batch // (micro * dp)
    if microbatches is not None and microbatches != count:
        raise LauncherError(
            f"microbatches={microbatches} but batch.global / (batch.micro x dp) = {global_batch} / "
            f"({micro} x {dp}) = {count}: set microbatches=null or change batch.global"
        )
    return count


# --- validity: the predicates both `plan` and `train` apply ---------------------------------------------
def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """The stage split: layer ids of each stage, contiguous, sizes differing by at most one, larger
    ones first (the last stage already carries the output projection and the loss)."""
    bounds = [0]
    for stage in range(n_stages):
        bounds.append(bounds[-1] + stage_size(n_layers, n_stages, stage))
    return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]


def stage_size(n_layers: int, n_stages: int, stage: int) -> int:
    """Blocks of one stage of `stage_layers`, without building the split (the planner asks often)."""
    base, extra = divmod(n_layers, n_stages)
    return base + (1 if stage < extra else 0)


def rank_stages(pp_rank: int, pp: int, virtual_stages: int, v_shape: bool = False) -> list[int]:
    """The stages one pipeline rank holds: r, r + pp, ... (the looped placement of interleaved 1F1B),
    or r and 2 pp - 1 - r in a V (zbv, dualpipev: torch's `generate_stage_to_rank_mapping(style="v")`,
    so rank 0 holds both the embedding and the loss)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def _tensor_parallel(lay: Layout, m: ModelConfig, seq_len: int) -> str | None:
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


def _sequence_parallel(lay: Layout, m: ModelConfig, seq_len: int) -> str | None:
    if lay.sequence_parallel and lay.tp == 1:
        return "sequence_parallel=true needs tensor parallelism: set tp>1 or sequence_parallel=false"
    if lay.sequence_parallel and seq_len % (lay.tp * lay.cp):
        cp = f" x cp={lay.cp}" if lay.cp > 1 else ""
        return f"sequence_parallel=true shards the sequence: seq_len={seq_len} must be a multiple of tp={lay.tp}{cp}"
    return None


def _context_parallel(lay: Layout, m: ModelConfig, seq_len: int) -> str | None:
    chunks = 2 * lay.cp  # rank i holds chunks i and 2cp-1-i: the same causal work on every rank
    if lay.cp > 1 and seq_len % chunks:
        fits = [c for c in divisors(seq_len // 2) if c > 1][:6] if seq_len % 2 == 0 else []
        choice = f"cp in {{{', '.join(map(str, fits))}}}" if fits else "an even seq_len"
        return (
            f"cp={lay.cp} splits each sequence into 2 x cp = {chunks} equal chunks: seq_len={seq_len} is not a "
            f"multiple of {chunks}: use seq_len={(seq_len // chunks + 1) * chunks} or {choice}"
        )
    return None


def _stages(lay: Layout, m: ModelConfig, seq_len: int) -> str | None:
    if lay.pp == 1 and (lay.schedule != "1f1b" or lay.virtual_stages > 1):  # pipeline-only keys, no pipeline
        key = "pp_schedule" if lay.schedule != "1f1b" else "virtual_stages"
        value = lay.schedule if key == "pp_schedule" else lay.virtual_stages
        return f"{key}={value} schedules pipeline stages, and pp=1 has none: set pp=2 or more, or drop {key}"
    if lay.virtual_stages > 1 and lay.schedule not in MULTI_STAGE:
        return (
            f"virtual_stages={lay.virtual_stages} needs pp_schedule=interleaved_1f1b or interleaved_zb "
            f"(got {lay.schedule})"
        )
    if lay.pp > 1 and lay.schedule in V_SHAPED and lay.virtual_stages != 2:
        return f"pp_schedule={lay.schedule} holds exactly 2 stages per rank (a V): set virtual_stages=2"
    stages = lay.pp * lay.virtual_stages
    if stages > m.n_layers and lay.schedule in V_SHAPED:
        return (
            f"pp_schedule={lay.schedule} needs 2 x pp = {stages} stages, more than model.n_layers={m.n_layers}: "
            f"use pp <= {m.n_layers // 2} or pp_schedule=1f1b"
        )
    if stages > m.n_layers:
        return (
            f"pp x virtual_stages = {lay.pp} x {lay.virtual_stages} = {stages} stages exceed "
            f"model.n_layers={m.n_layers}: use at most {m.n_layers} stages (uneven splits are fine)"
        )
    if lay.pp > 1 and m.tied_embeddings:
        return (
            "model.tied_embeddings=true shares the embedding of the first pipeline stage with the output "
            "projection of the last: set pp=1 or model.tied_embeddings=false"
        )
    return None


def _microbatches(lay: Layout, m: ModelConfig, seq_len: int) -> str | None:
    if lay.pp == 1:
        return None
    if lay.microbatches < lay.pp:
        return (
            f"{lay.microbatches} microbatches per step cannot fill pp={lay.pp} stages: set microbatches "
            f"(or batch.global / (batch.micro x dp)) to at least {lay.pp}"
        )
    if lay.schedule in ("interleaved_1f1b", "interleaved_zb") and lay.microbatches % lay.pp:
        return (
            f"microbatches={lay.microbatches} is not a multiple of pp={lay.pp} ({lay.schedule}): "
            f"use {(lay.microbatches // lay.pp + 1) * lay.pp}"
        )
    if lay.schedule == "dualpipev" and lay.microbatches < 2 * lay.pp:
        return (
            f"{lay.microbatches} microbatches per step cannot fill the 2 x pp = {2 * lay.pp} stages of dualpipev: "
            f"set microbatches (or batch.global / (batch.micro x dp)) to at least {2 * lay.pp}"
        )
    return None


def _recompute(lay: Layout, m: ModelConfig, seq_len: int) -> str | None:
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


def _expert_parallel(lay: Layout, m: ModelConfig, seq_len: int) -> str | None:
    if lay.ep > 1 and not m.moe.experts:
        return f"ep={lay.ep} needs a mixture-of-experts model: set ep=1 or model.moe.experts>0"
    if m.moe.experts % lay.ep:
        return f"ep={lay.ep} does not divide model.moe.experts={m.moe.experts}: use an ep that divides it"
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


Rule = Callable[[Layout, ModelConfig, int], str | None]
RULES: tuple[Rule, ...] = (
    _tensor_parallel,
    _context_parallel,
    _sequence_parallel,
    _stages,
    _microbatches,
    _recompute,
    _expert_parallel,
)


def violations(lay: Layout, m: ModelConfig, seq_len: int) -> Iterator[str]:
    """What is wrong with `lay` for this model and sequence length: one line each, naming the key
    and the fix. `plan` skips such layouts, `train` refuses them, both through this."""
    for rule in RULES:
        problem = rule(lay, m, seq_len)
        if problem:
            yield problem


def check(lay: Layout, m: ModelConfig, seq_len: int) -> None:
    """`train`'s refusal: the first violation, as a LauncherError."""
    problem = next(violations(lay, m, seq_len), None)
    if problem:
        raise LauncherError(problem)


def from_config(cfg: TrainConfig, world: int | None) -> Layout:
    """The layout a config fixes completely (no `auto` but the dp degrees), checked."""
    batch = cfg.batch
    degrees = given_degrees(cfg)
    ep = degrees["ep"] or 1
    tp, pp, cp, replicate, shard = fixed_degrees(degrees, world, ep)
    micro = int_or_auto("batch.micro", batch.get("micro"))
    if micro is None:
        raise LauncherError("batch.micro=auto is the planner's choice: give a world size or a value")
    global_batch = int_or_auto("batch.global", batch.get("global"), auto=None)
    count = microbatch_count(
        micro, replicate * shard, pp, global_batch, int_or_auto("microbatches", cfg.microbatches, None)
    )
    v = int_or_auto("virtual_stages", cfg.virtual_stages, auto=None) or 1
    if cfg.pp_schedule in V_SHAPED and v == 1:  # the default: a V is two stages per rank
        v = 2
    layers = recompute_layers_of(cfg.recompute_layers)
    if layers is None:
        raise LauncherError("recompute_layers=auto is the planner's choice: give a world size or a value")
    sp, reshard = bool(cfg.sequence_parallel), cfg.fsdp.reshard_after_forward
    lay = Layout(tp, pp, replicate, shard, micro, count, cfg.pp_schedule, v, cfg.recompute, sp, layers, reshard, cp, ep)
    check(lay, cfg.model, cfg.seq_len)
    if lay.zero_bubble and cfg.compile is True:
        raise LauncherError(
            f"pp_schedule={lay.schedule} splits the backward into input and weight gradients, which torch.compile'd "
            "stages do not support: set compile=false (compile=auto leaves these stages eager)"
        )
    return lay


def async_tp_applies(layout: Layout, async_tp: bool) -> bool:
    """Whether torch's async TP overlaps this layout's TP collectives (`async_tp`: asked for, and the
    config checks passed: cuda, compile, sequence parallelism): with TP, and blocks that are compiled
    (zero-bubble schedules leave them eager; parallel/__init__.py `_compile`)."""
    return async_tp and layout.tp > 1 and layout.sequence_parallel and not layout.zero_bubble


# --- where it runs ---------------------------------------------------------------------------------------
def rank_of(layout: Layout, pp: int = 0, dp_replicate: int = 0, dp_shard: int = 0, tp: int = 0, cp: int = 0) -> int:
    """The rank at these coordinates (the order in the module docstring)."""
    inner = cp + layout.cp * (dp_shard + layout.dp_shard * (dp_replicate + layout.dp_replicate * pp))
    return tp + layout.tp * inner


def owner_rank(layout: Layout) -> int:
    """Rank 0 of the last pipeline stage: it owns the user-facing output (pipeline rank 0 in a V)."""
    return rank_of(layout, pp=layout.last_rank)


def build_mesh(layout: Layout, device_type: str = "cpu", copies: int = 1):  # -> DeviceMesh
    """The DeviceMesh of the layout, dimensions named pp, dp_replicate, dp_shard, cp, tp (row-major, so
    the mesh's rank order is exactly `rank_of`). The data-parallel rank is
    dp_replicate_rank * dp_shard + dp_shard_rank, as in `Layout.coordinates`.

    `copies` > 1 runs that many independent copies of the layout side by side in one world of
    copies x world_size ranks (tests use it to run two 2-rank cases in one 4-process launch); the
    mesh returned is this rank's copy.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
    if copies > 1:
        mesh = init_device_mesh(device_type, (copies, *shape), mesh_dim_names=("copy", *MESH_DIMS))[MESH_DIMS]
    else:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    if layout.cp > 1:  # FSDP shards over dp_shard x cp (launcher/parallel/data.py)
        from launcher.compat import flatten_mesh

        flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
    return mesh


def expert_mesh(layout: Layout, device_type: str = "cpu"):  # -> DeviceMesh
    """The mesh expert parallelism runs on: dp_shard split into (edp, ep), ep inner, so the ranks are
    those of `build_mesh` (dims pp, dp_replicate, edp, ep, cp, tp). The experts are sharded over "ep", and
    FSDP-sharded over "edp" by the ranks holding the same ones (launcher/parallel/expert.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pp, layout.dp_replicate, layout.edp, layout.ep, layout.cp, layout.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "edp", "ep", "cp", "tp"))


def check_environment(cfg: TrainConfig, layout: Layout, local: bool) -> None:
    """What this machine must offer to start the layout's workers here (`local`: not torchrun/SLURM)."""
    per_node = workers_per_node(layout.world_size, cfg.nodes)
    if local and per_node > cfg.max_local_workers and cfg.hardware.kind == "cpu":
        raise LauncherError(
            f"layout needs {layout.world_size} local workers, more than max_local_workers={cfg.max_local_workers} "
            f"({os.cpu_count()} CPU cores here): lower tp/pp/dp, or raise max_local_workers"
        )
    if cfg.hardware.kind not in ("cpu", "cuda"):  # a profile to plan with (tpu): nothing here runs on it
        raise LauncherError(
            f"hardware={cfg.hardware.name} is a planner-only profile (kind {cfg.hardware.kind}): `train` runs on "
            f"CPUs and CUDA GPUs: use `plan` with it, or dry_run=true to only check the layout"
        )
    if cfg.hardware.kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise LauncherError(
                f"hardware={cfg.hardware.name} is a GPU profile but no CUDA device is visible: "
                f"use hardware=cpu, or dry_run=true to only check the layout"
            )
        if local and torch.cuda.device_count() < per_node:
            raise LauncherError(
                f"{per_node} workers per node need {per_node} GPUs, found {torch.cuda.device_count()}: "
                f"set hardware.devices_per_node={torch.cuda.device_count()} or lower tp/pp/dp"
            )
