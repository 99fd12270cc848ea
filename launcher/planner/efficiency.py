"""Compute efficiency: the share of peak a layout's FLOPs run at. One model for every machine.

Compute runs at peak x matmul_efficiency (one number per machine, in its hardware profile) x the
efficiency of the GEMMs at their per-device shapes / (1 + H0 g / h):
- GEMM shapes: a block's weight matmuls multiply (tokens x K) by (K x N) with K or N divided by the
  tensor-parallel degree (the QKV and MLP-in outputs, the output-projection and MLP-out inputs). A
  GEMM whose narrow side d = min(K, N, tokens) is small fills the device's tiles and waves worse and
  re-reads its operands more per FLOP: it runs at 1 / (1 + G0 / d) of a wide one. The block's
  GEMMs are weighted by their FLOPs (time adds up), so tp = 8 on a narrow model (h 4096: K = 512 on
  the output projection) is slower per FLOP than on a wide one.
- The work that is not matmul (norms, activations, softmax, residuals, optimizer) grows like h per
  token while matmul work grows like h^2, so its share falls like 1/h; H0 is the width at which
  both would take equal time. That work is bound by memory bandwidth and the matmuls by FLOP/s, so
  H0 = NONMATMUL x (peak FLOP/s / memory bytes/s) with one NONMATMUL for every accelerator (an
  H100 does 295 FLOP per byte, an A100 153: the same model loses more to its elementwise work on
  an H100). Without sequence parallelism TP leaves a share (REPLICATED) of that work undivided, so
  per device it weighs g = 1 + REPLICATED (t - 1) times more.
"""

from __future__ import annotations

from launcher.config.model import ModelConfig
from launcher.flops import head_dim, kv_heads
from launcher.hardware.machine import Machine
from launcher.layout import Layout

# Model width at which the non-matmul work takes as long as the matmuls. It scales with the device's
# FLOP/byte ratio: accelerators (~150-300 FLOP per byte of memory traffic) share one value, set by the
# published runs. A CPU's is measured (the cpu profile's `nonmatmul_width`, launcher/hardware/probes/block.py):
# its GEMM speed against the rest moves with the host. Where a profile gives neither a width nor a memory
# bandwidth, H0 by kind; cpu: the width measured when GEMMs ran at ~200 GFLOP/s on one thread here.
H0 = {"cuda": 1024.0, "tpu": 1024.0, "cpu": 180.0}
NONMATMUL = 4.0  # H0 per FLOP/byte of the device (612 on an A100, 1184 on an H100): fitted, docs/planner.md
# GEMM narrow side at which a GEMM runs at half the speed of a wide one (accelerators: 128 x 128 or
# 256 x 128 output tiles per SM, so a side of a few hundred already wastes a share of each wave);
# fitted on the published runs; on a CPU not measured, so 0 (the calibrated GEMM peak alone, as before)
G0 = {"cuda": 64.0, "tpu": 64.0, "cpu": 0.0}
REPLICATED = 0.15  # share of the non-matmul work that TP leaves replicated without sequence parallelism


def gemm_efficiency(m: ModelConfig, tp: int, tokens: int, g0: float) -> float:
    """The block's weight GEMMs at their per-device shapes, FLOP-weighted, relative to wide GEMMs."""
    h, t = m.dim, tp
    hq, hkv = m.n_heads * head_dim(m), kv_heads(m) * head_dim(m)
    mlp_in = (2 if m.mlp == "swiglu" else 1) * m.ffn_dim
    shapes = ((h, (hq + 2 * hkv) / t), (hq / t, h), (h, mlp_in / t), (m.ffn_dim / t, h))  # (K, N)
    flops = [k * n for k, n in shapes]
    time = [k * n * (1.0 + g0 / min(k, n, tokens)) for k, n in shapes]
    return sum(flops) / sum(time)


def nonmatmul_width(machine: Machine) -> float:
    """H0: the model width at which the work that is not matmul takes as long as the matmuls."""
    if machine.nonmatmul_width:
        return machine.nonmatmul_width
    if machine.memory_bandwidth:
        return NONMATMUL * machine.flop_per_byte
    return H0.get(machine.kind, H0["cuda"])


def non_matmul_share(machine: Machine, m: ModelConfig, layout: Layout) -> float:
    """Time of the non-matmul work relative to the matmul work (H0 g / h, the module docstring)."""
    t = layout.tp
    spread = 1.0 if layout.sequence_parallel or t == 1 else 1.0 + REPLICATED * (t - 1)
    return nonmatmul_width(machine) * spread / m.dim


def compute_efficiency(machine: Machine, m: ModelConfig, layout: Layout, tokens: int) -> float:
    """Achieved share of peak for this model and layout, `tokens` per microbatch (see the module docstring)."""
    gemm = gemm_efficiency(m, layout.tp, tokens, G0.get(machine.kind, G0["cuda"]))
    return machine.matmul_efficiency * gemm / (1.0 + non_matmul_share(machine, m, layout))
