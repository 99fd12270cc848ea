"""Parallel degrees → world size and rank order.

Ranks are ordered tp innermost (a tensor-parallel group sits inside the fastest link domain), then
data parallel (replicate outer, shard inner), then pipeline outermost:
    rank = tp_rank + tp * (dp_shard_rank + dp_shard * (dp_replicate_rank + dp_replicate * pp_rank))
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from launcher.config import LauncherError, TrainConfig, positive_int


def divisors(n: int) -> list[int]:
    """Every divisor of `n`, ascending: the degrees a dimension of `n` ranks can be split into."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's position along each mesh dimension (the inverse of the order above)."""
        tp_rank, rest = rank % self.tp, rank // self.tp
        shard, rest = rest % self.dp_shard, rest // self.dp_shard
        replicate, pp_rank = rest % self.dp_replicate, rest // self.dp_replicate
        return {
            "pp": pp_rank,
            "dp_replicate": replicate,
            "dp_shard": shard,
            "tp": tp_rank,
            "dp": replicate * self.dp_shard + shard,
        }


def _degree(cfg: TrainConfig, key: str) -> int | None:
    value = getattr(cfg, key)
    if value == "auto":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LauncherError(f"{key}={value}: a parallel degree is a positive integer or auto")
    return value


def with_degrees(cfg: TrainConfig, layout: Layout) -> TrainConfig:
    """`cfg` with its `auto` degrees replaced by the resolved layout's (what workers and the planner read)."""
    return dataclasses.replace(
        cfg, tp=layout.tp, pp=layout.pp, dp=layout.dp, dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate
    )


def resolve_layout(cfg: TrainConfig, world_size: int | None = None) -> Layout:
    """Fill `auto` degrees: dp takes the ranks that remain (1 when the world size is free)."""
    tp, pp = _degree(cfg, "tp") or 1, _degree(cfg, "pp") or 1
    dp = _degree(cfg, "dp")
    if dp is None:
        if world_size is not None and world_size % (tp * pp):
            raise LauncherError(f"world size {world_size} is not divisible by tp*pp={tp * pp}: change tp or pp")
        dp = world_size // (tp * pp) if world_size else 1
    if world_size is not None and tp * pp * dp != world_size:
        raise LauncherError(
            f"tp*pp*dp={tp}*{pp}*{dp}={tp * pp * dp} does not match the world size {world_size}: set dp=auto"
        )
    shard, replicate = _degree(cfg, "dp_shard"), _degree(cfg, "dp_replicate")
    if shard is None and replicate is None:
        shard, replicate = dp, 1
    elif shard is None:
        shard = dp // replicate if dp % replicate == 0 else 0
    elif replicate is None:
        replicate = dp // shard if dp % shard == 0 else 0
    if not shard or not replicate or shard * replicate != dp:
        raise LauncherError(
            f"dp_replicate={cfg.dp_replicate} x dp_shard={cfg.dp_shard} must equal dp={dp}: set one of them to auto"
        )
    return Layout(tp=tp, pp=pp, dp_replicate=replicate, dp_shard=shard)


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: the rank order above


def rank_of(layout: Layout, pp: int = 0, dp_replicate: int = 0, dp_shard: int = 0, tp: int = 0) -> int:
    """The rank at these coordinates (the order in the module docstring)."""
    return tp + layout.tp * (dp_shard + layout.dp_shard * (dp_replicate + layout.dp_replicate * pp))


def owner_rank(layout: Layout) -> int:
    """Rank 0 of the last pipeline stage: it owns the user-facing output."""
    return rank_of(layout, pp=layout.pp - 1)


def build_mesh(layout: Layout, device_type: str = "cpu", copies: int = 1):  # -> DeviceMesh
    """The DeviceMesh of the layout, dimensions named pp, dp_replicate, dp_shard, tp (row-major, so
    the mesh's rank order is exactly `rank_of`). The data-parallel rank is
    dp_replicate_rank * dp_shard + dp_shard_rank, as in `Layout.coordinates`.

    `copies` > 1 runs that many independent copies of the layout side by side in one world of
    copies x world_size ranks (tests use it to run two 2-rank cases in one 4-process launch); the
    mesh returned is this rank's copy.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp)
    if copies > 1:
        mesh = init_device_mesh(device_type, (copies, *shape), mesh_dim_names=("copy", *MESH_DIMS))[MESH_DIMS]
    else:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    return mesh


def launch_world_size(cfg: TrainConfig, env_world_size: int | None) -> int | None:
    """The world size the launch imposes, if any: the environment's (torchrun, SLURM), else
    nodes x devices_per_node on a GPU profile; None on the cpu profile (the degrees decide)."""
    if env_world_size is not None:
        return env_world_size
    if cfg.hardware.kind == "cuda":
        return cfg.nodes * cfg.hardware.devices_per_node
    return None


def local_batch_size(cfg: TrainConfig, layout: Layout) -> int:
    """Sequences per step on one data-parallel rank."""
    return (cfg.batch["global"] or cfg.batch["micro"] * layout.dp) // layout.dp


def pipeline_microbatches(cfg: TrainConfig, layout: Layout) -> int:
    """`microbatches`, or by default 2 x pp when that divides the local batch, else the smallest
    divisor of the local batch that is at least pp (else the largest divisor: an error later)."""
    if cfg.microbatches:
        return cfg.microbatches
    local = local_batch_size(cfg, layout)
    if local % (2 * layout.pp) == 0:
        return 2 * layout.pp
    options = divisors(local)
    return next((d for d in options if d >= layout.pp), options[-1])


def check_layout(cfg: TrainConfig, layout: Layout, local: bool = True) -> None:
    """Everything about the layout that can be checked before a process starts: one LauncherError
    naming the key and the fix. `local`: the workers would be started here (not torchrun/SLURM)."""
    m = cfg.model
    kv = m.n_kv_heads or m.n_heads
    if layout.tp > 1:
        shared = math.gcd(math.gcd(m.n_heads, kv), math.gcd(m.ffn_dim, m.vocab_size))
        fits = ", ".join(str(d) for d in divisors(shared))
        for key, value, what in (
            ("model.n_heads", m.n_heads, "attention heads are split over the tensor-parallel ranks"),
            ("model.n_kv_heads", kv, "KV heads are split over the tensor-parallel ranks"),
            ("model.ffn_dim", m.ffn_dim, "the MLP hidden width is split over the tensor-parallel ranks"),
            ("model.vocab_size", m.vocab_size, "the vocabulary is split over the tensor-parallel ranks"),
        ):
            if value % layout.tp:
                raise LauncherError(f"tp={layout.tp} does not divide {key}={value} ({what}): use tp in {{{fits}}}")
    if cfg.sequence_parallel and layout.tp == 1:
        raise LauncherError("sequence_parallel=true needs tensor parallelism: set tp>1 or sequence_parallel=false")
    if cfg.sequence_parallel and cfg.seq_len % layout.tp:
        raise LauncherError(
            f"sequence_parallel=true shards the sequence: seq_len={cfg.seq_len} must be a multiple of tp={layout.tp}"
        )
    positive_int(cfg.virtual_stages, "virtual_stages")
    positive_int(cfg.microbatches, "microbatches", allow_none=True)
    if cfg.virtual_stages > 1 and cfg.pp_schedule != "interleaved_1f1b":
        raise LauncherError(
            f"virtual_stages={cfg.virtual_stages} needs pp_schedule=interleaved_1f1b (got {cfg.pp_schedule})"
        )
    stages = layout.pp * cfg.virtual_stages
    if stages > m.n_layers:
        raise LauncherError(
            f"pp x virtual_stages = {layout.pp} x {cfg.virtual_stages} = {stages} stages exceed "
            f"model.n_layers={m.n_layers}: use at most {m.n_layers} stages (uneven splits are fine)"
        )
    if layout.pp > 1:
        if m.tied_embeddings:
            raise LauncherError(
                "model.tied_embeddings=true shares the embedding of the first pipeline stage with the output "
                "projection of the last: set pp=1 or model.tied_embeddings=false"
            )
        micro = pipeline_microbatches(cfg, layout)
        local_batch = local_batch_size(cfg, layout)
        if micro < layout.pp:
            raise LauncherError(
                f"microbatches={micro} is below pp={layout.pp}: use at least {layout.pp}"
                if cfg.microbatches
                else f"the {local_batch} sequences per data-parallel rank cannot fill pp={layout.pp} stages: "
                f"raise batch.global (or batch.micro) to a multiple of {layout.pp} per data-parallel rank"
            )
        if cfg.pp_schedule == "interleaved_1f1b" and micro % layout.pp:
            raise LauncherError(
                f"microbatches={micro} is not a multiple of pp={layout.pp} (interleaved_1f1b): "
                f"use {(micro // layout.pp + 1) * layout.pp}"
            )
        if local_batch % micro:
            raise LauncherError(
                f"the {local_batch} sequences per data-parallel rank do not split into microbatches={micro}: "
                f"set microbatches to a divisor of {local_batch}, or change batch.global / batch.micro"
            )
    if cfg.dry_run:
        return
    if local and layout.world_size // cfg.nodes > cfg.max_local_workers and cfg.hardware.kind == "cpu":
        raise LauncherError(
            f"layout needs {layout.world_size} local workers, more than max_local_workers={cfg.max_local_workers} "
            f"({os.cpu_count()} CPU cores here): lower tp/pp/dp, or raise max_local_workers"
        )
    if cfg.hardware.kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise LauncherError(
                f"hardware={cfg.hardware.name} is a GPU profile but no CUDA device is visible: "
                f"use hardware=cpu, or dry_run=true to only check the layout"
            )
        per_node = layout.world_size // cfg.nodes
        if local and torch.cuda.device_count() < per_node:
            raise LauncherError(
                f"{per_node} workers per node need {per_node} GPUs, found {torch.cuda.device_count()}: "
                f"set hardware.devices_per_node={torch.cuda.device_count()} or lower tp/pp/dp"
            )
