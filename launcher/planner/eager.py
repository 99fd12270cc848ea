"""What an eager block pays over a compiled one (`compile`, docs/planner.md "Compilation").

torch.compile (Inductor), XLA on a TPU, and Megatron's hand-fused kernels turn a block's chains of
pointwise ops (the norms, RoPE, SwiGLU's silu x up, the residual adds, dropout) into one kernel each
that reads its inputs and writes its outputs once. Eager PyTorch runs every op as its own kernel that
reads and writes the whole tensor, and the composite RMSNorm (torch < 2.8, the published eager runs)
upcasts to fp32 on the way. The matmuls and fused attention are the same kernels either way, and the
efficiency model's non-matmul share (launcher/planner/efficiency.py) is fitted on runs that fused:
compiled costs nothing more, eager adds

- the bytes its extra passes move, per token and layer: `PASSES` (element reads and writes of each
  op's width, in the compute dtype, forward and backward) eager minus compiled, the forward again
  where recompute repeats it, at EAGER_BANDWIDTH of the profile's memory bandwidth;
- a floor on the block's time: the host issues one launch per kernel (LAUNCH_S each), and a device
  that runs the block faster than that waits for them.

A profile without a memory bandwidth (cpu) counts none of it: its host time is calibrated as a whole.
"""

from __future__ import annotations

from launcher.config.model import ModelConfig
from launcher.flops import head_dim, kv_heads
from launcher.layout import Layout

# Element passes per element of the op's width and token: (eager forward, eager backward, compiled
# forward, compiled backward), each a read or write of one tensor in the compute dtype (an fp32 copy
# counts 2). Counted from the ops each runs:
# - rmsnorm, composite: to fp32 (r1 w2), pow (r2 w2), mean (r2), x rstd (r2 w2), to bf16 (r2 w1),
#   x weight (r1 w1) = 18; its autograd backward ~32; fused: read x, write y; backward x, dy -> dx, (dw)
# - layernorm: one kernel each way eager too (F.layer_norm), its weight gradients a second pass
# - residual add: r2 w1; backward the two branches' gradients summed (r2 w1); fused into the norm's kernel
# - rope (q and k): x cos (2), the negated half (1), cat (2), x sin (2), add (3); backward ~13
# - swiglu: silu (2), x up (3); backward the two products and silu's gradient (9); fused r2 w1, r3 w2
# - gelu: one kernel each way eager too; Inductor leaves cuBLAS's GEMMs (its epilogue) alone
# - dropout (residual branches): the mask (1 byte, half a bf16 pass) and the product; fused into the add
PASSES = {
    "rmsnorm": (18, 32, 2, 5),
    "layernorm": (2, 6, 2, 5),
    "residual": (3, 3, 1, 1),
    "rope": (10, 13, 2, 2),
    "swiglu": (5, 9, 3, 5),
    "gelu": (2, 3, 2, 3),
    "dropout": (2.5, 2.5, 0.5, 0.5),
}
# Kernels per op (eager forward + backward; a compiled block's pointwise ops: one kernel per region
# each way, counted per block in COMPILED_KERNELS): the op lists above
KERNELS = {"rmsnorm": 14, "layernorm": 3, "residual": 2, "rope": 12, "swiglu": 5, "gelu": 2, "dropout": 3}
COMPILED_KERNELS = 8  # norm+add (x2), rope, swiglu/gelu forward; the same backward
GEMM_KERNELS = 3 * 7 + 2  # 7 weight GEMMs (forward, input and weight gradients) and attention's two
# Share of the memory bandwidth eager's pointwise kernels reach: fitted on torchtitan's Llama 3.1 8B
# FSDP runs with and without torch.compile on 8 and 128 H100s (bench/published_runs.py, 1.157 and 1.162
# tokens/s compiled over eager); small kernels with fp32 copies and broadcast reads stream below peak.
EAGER_BANDWIDTH = 0.72
# Host time to issue one kernel from eager PyTorch (dispatch + cudaLaunchKernel, ~4-10 us per op on a
# current CPU; compiled code launches its few kernels from generated code for about the same each)
LAUNCH_S = 5e-6


def _ops(m: ModelConfig, layout: Layout) -> dict[str, tuple[int, float]]:
    """Each pointwise op of a block: (how many, its width per token on one device in elements)."""
    t = layout.tp
    h = m.dim / t if layout.sequence_parallel else m.dim  # replicated across TP ranks without it
    ops = {m.norm: (2, h), "residual": (2, h), m.mlp: (1, m.ffn_dim / t)}
    if m.positions == "rope":
        ops["rope"] = (1, (m.n_heads + kv_heads(m)) * head_dim(m) / t)
    if m.dropout > 0:
        ops["dropout"] = (2, h)
    return ops


def repeated_forward(layout: Layout) -> float:
    """Forwards a block runs per step: recompute (selective or full) repeats its pointwise forward."""
    return 2.0 if layout.recompute in ("selective", "full") else 1.0


def eager_bytes(m: ModelConfig, layout: Layout, elem: int) -> float:
    """Bytes per token and layer that one device's eager block moves beyond a compiled one."""
    fwd = repeated_forward(layout)
    extra = 0.0
    for op, (count, width) in _ops(m, layout).items():
        ef, eb, cf, cb = PASSES[op]
        extra += count * width * ((ef - cf) * fwd + (eb - cb))
    return extra * elem


def pointwise_seconds(m: ModelConfig, layout: Layout, bandwidth: float, elem: int, compiled: bool) -> float:
    """Seconds per token and layer of eager's extra pointwise traffic (0 compiled or without a bandwidth)."""
    if compiled or not bandwidth:
        return 0.0
    return eager_bytes(m, layout, elem) / (EAGER_BANDWIDTH * bandwidth)


def launch_seconds(m: ModelConfig, layout: Layout, compiled: bool) -> float:
    """Host seconds to launch one block's kernels, forward and backward (recompute repeats the forward's)."""
    ops = _ops(m, layout).items()
    pointwise = COMPILED_KERNELS if compiled else sum(count * KERNELS[op] for op, (count, _) in ops)
    return (GEMM_KERNELS + pointwise * (1 + (repeated_forward(layout) - 1) / 3)) * LAUNCH_S
