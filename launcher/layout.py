"""Parallel degrees → world size and rank order.

Ranks are ordered tp innermost (a tensor-parallel group sits inside the fastest link domain), then
data parallel (replicate outer, shard inner), then pipeline outermost:
    rank = tp_rank + tp * (dp_shard_rank + dp_shard * (dp_replicate_rank + dp_replicate * pp_rank))
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import LauncherError, TrainConfig


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
        return {"pp": pp_rank, "dp_replicate": replicate, "dp_shard": shard, "tp": tp_rank,
                "dp": replicate * self.dp_shard + shard}


def _degree(cfg: TrainConfig, key: str) -> int | None:
    value = getattr(cfg, key)
    if value == "auto":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LauncherError(f"{key}={value}: a parallel degree is a positive integer or auto")
    return value


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
