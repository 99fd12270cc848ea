"""The frozen `Layout`: a run's resolved parallel layout, and where its stages sit.

`Layout` holds the degrees, the batch split, the pipeline schedule, recompute and sequence
parallelism. `planner.resolve` builds it once (the CLI's only call into the planner); the planner
scores candidates built with the same rules (launcher/layout/rules.py); parallelize, the loop, the
dry run and SLURM read it and never re-derive anything from the raw config. No torch here: `plan`
imports this on accelerator profiles.

Ranks are ordered tp innermost (a tensor-parallel group sits inside the fastest link domain), then
context parallel, then data parallel (replicate outer, shard inner), then pipeline outermost:
    rank = tp_rank + tp * (cp_rank + cp * (dp_shard_rank + dp_shard * (dp_replicate_rank + dp_replicate * pp_rank)))
Context-parallel ranks see the same sequences (each its chunks of them) and hold identical weights:
FSDP shards over dp_shard x cp together, as torchtitan does (launcher/parallel/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.layout.schedules import SCHEDULE, Schedule

RECOMPUTE = ("none", "selective", "full")  # activation checkpointing (launcher/parallel/recompute.py)
RESHARD = ("always", "never", "auto")  # fsdp.reshard_after_forward (launcher/parallel/data.py)
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
    schedule: str = "1f1b"  # pipeline schedule (a name of launcher/layout/schedules.py), read when pp > 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules; in a V: 2)
    recompute: str = "none"  # RECOMPUTE: the policy of every block not in recompute_layers
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
    def pipe(self) -> Schedule:
        """The pipeline schedule's row: its placement, rules and formulas (launcher/layout/schedules.py)."""
        return SCHEDULE[self.schedule]

    @property
    def v_shape(self) -> bool:
        """Stages placed in a V (zbv, dualpipev): the first and the last stage share pipeline rank 0."""
        return self.pp > 1 and self.pipe.v_shape

    @property
    def zero_bubble(self) -> bool:
        return self.pp > 1 and self.pipe.zero_bubble

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


# --- the stage split ----------------------------------------------------------------------------------
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
