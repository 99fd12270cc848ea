"""A candidate layout and the machine it runs on: the plain data the planner's models read.

`Layout` is one point of the search space (parallel degrees, batch split, schedule, recompute).
`Machine` is a hardware profile with every number resolved (FLOP/s, bytes, seconds), link levels
sorted from the innermost (fastest, smallest) to the outermost. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = float(2**30)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp_shard: int  # FSDP/ZeRO-3 degree (1: parameters replicated)
    dp_replicate: int  # DDP degree (HSDP when both > 1)
    micro: int  # sequences per microbatch per data-parallel rank
    microbatches: int  # microbatches per step per dp rank (pipeline microbatches / accumulation)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (ignored when pp == 1)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved_1f1b)
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro * self.microbatches * self.dp

    @property
    def sharding(self) -> str:
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "none"

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: virtual stages for the interleaved schedule, else 1."""
        return self.virtual_stages if self.pp > 1 and self.schedule == "interleaved_1f1b" else 1


@dataclass(frozen=True)
class Level:
    """One interconnect level: `size` devices share a domain; bandwidth per device, one direction."""

    name: str
    size: int
    bandwidth: float  # bytes/s per device
    latency: float  # seconds per hop
    gather_bandwidth: float | None = None  # all-gather, when the backend differs; None: bandwidth
    scatter_bandwidth: float | None = None  # reduce-scatter, likewise

    def time_sliced(self, share: float) -> Level:
        """This level when each process gets `share` of a core (CPU workers outnumbering the cores):
        the copies and reductions run slower, and a peer answers later."""
        return Level(
            self.name,
            self.size,
            self.bandwidth * share,
            self.latency / share,
            self.gather_bandwidth and self.gather_bandwidth * share,
            self.scatter_bandwidth and self.scatter_bandwidth * share,
        )


@dataclass(frozen=True)
class Machine:
    name: str
    kind: str  # cpu | cuda | tpu
    peak_flops: float  # per device
    memory_bytes: float  # per device
    matmul_efficiency: float
    devices_per_node: int
    levels: tuple[Level, ...]
    host_overhead: float = 0.0  # seconds per tensor-parallel block and microbatch (cpu: DTensor dispatch)
