"""The machine a layout runs on: the plain data the planner's models read (the layout itself is
`launcher.layout.Layout`).

`Machine` is a hardware profile with every number resolved (FLOP/s, bytes, seconds), link levels
sorted from the innermost (fastest, smallest) to the outermost. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    block_overhead: float = 0.0  # seconds per block and microbatch, fwd + bwd (cpu: the framework's dispatch)
    optimizer_time: float = 0.0  # seconds per parameter a device updates, per step (cpu: fused AdamW)
    memory_bandwidth: float | None = None  # bytes/s of device memory (None: not given, cpu)
