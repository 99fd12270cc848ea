"""The seam between configuration and runtime, part one: `BuildOptions`, the few decisions about how
to build and run the model that the layout does not hold, each resolved once from the config
(`planner.resolve`). `parallelize` reads only these, the Layout and the mesh; the worker's whole run
is launcher/config/run.py's `Run`. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Options:
    """dtype=fp8 (launcher/parallel/float8.py): which torchao recipe, emulated or not, which layers."""

    recipe: str  # tensorwise | rowwise | rowwise_with_gw_hp
    emulate: bool  # torchao's emulation: quantize, dequantize, matmul in high precision (any device)
    min_features: int  # a layer with in or out features below this stays high precision
    fsdp_float8_all_gather: bool  # FSDP2 gathers the weights in float8 (cuda, tensorwise), scales precomputed
    peak_flops: float  # per device, the profile's fp8 peak: mfu_fp8_peak's denominator (0: none, emulated)


@dataclass(frozen=True)
class BuildOptions:
    """How the runtime builds and measures the model (everything about the cut is in the Layout)."""

    seed: int
    precision: str  # fp32 | fsdp_bf16 | autocast_bf16 (launcher/config/precision.py)
    compile: bool  # torch.compile per block (compile=auto resolved)
    async_tp: bool  # torch's async TP overlaps this layout's TP collectives (asked for, and it applies)
    seq_len: int
    init_from: str | None  # a Hugging Face folder the weights start from (init.from); None: seeded random
    device: str  # the hardware kind: cuda | cpu
    threads: int  # torch intra-op threads per worker
    peak_flops: float  # per device: the MFU's denominator
    flop_per_byte: float  # the device's peak over its memory bandwidth: the chunked loss's chunk size
    fp8: Fp8Options | None = None  # dtype=fp8; precision is then the bf16 mode for everything else
    document_eos: int | None = None  # data.document_mask: the id ending each document; None: plain causal
    compile_backend: str = "inductor"  # torch.compile's backend (tests: aot_eager, the same graphs unfused)
