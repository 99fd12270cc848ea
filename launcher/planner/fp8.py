"""FP8 matmuls (dtype=fp8: torchao's float8 training of the blocks' linear layers): what the planner
predicts they save and cost. Pure Python.

Which layers: those of every block's attention projections (q, k, v, o) and dense MLP that the runtime
converts, by its own rule (`precision.fp8_layer`: fp8.min_features, TP shards of multiples of 16; 1b's
wk and wv, 512 features, stay bf16); the output projection and the router stay bf16, and so do MoE's
routed and shared experts (the planner does not count FP8 grouped GEMMs: a MoE model's prediction is
conservative).

Time, per microbatch of the busiest pipeline rank (launcher/planner/compute.py, cost.py):
- Matmuls: the converted layers' FLOPs run at peak_tflops_fp8 x fp8_matmul_efficiency instead of
  peak_tflops x matmul_efficiency (the same GEMM shapes, so the shape efficiency divides both):
  their seconds at the bf16 rate shrink by that ratio (`Fp8.speedup`). rowwise_with_gw_hp keeps the
  weight-gradient GEMM, a third of a linear's FLOPs, in bf16. `fp8.emulate=true` (no FP8 units):
  speed-up 1.
- Casts: each converted tensor takes an amax pass and a cast through memory, none hidden behind the
  matmuls: CAST_BYTES per element (by recipe) of every converted layer's input and output gradient
  (tokens x K and tokens x N per device) and its weight (K x N per device; under the float8 all-gather
  only the local shard, at each gather), at the profile's memory bandwidth; the forward's again for a
  block recomputed in full.
- FSDP, tensorwise only: the converted weights are all-gathered in fp8 (torchao's float8 all-gather,
  scales precomputed after the optimizer step): 1 byte per element instead of the compute dtype's.
Memory: the fp8 weight copies the forward casts and backward reuses (COPIES per converted weight
element and device; none under the float8 all-gather, where the gathered copy is the fp8 one), and
their scales (fp32: one per tensor tensorwise, one per row and column rowwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.model import ModelConfig
from launcher.config.precision import COLUMN, fp8_layer
from launcher.config.validate import block_linears
from launcher.flops import moe_layer_count
from launcher.layout import Layout

# Bytes of memory traffic per converted element and microbatch (bf16 in, fp8 out). tensorwise: amax
# (read 2) + scale-and-cast (read 2, write 1) + the transposed fp8 copy the backward GEMMs read (read 1,
# write 1) = 7. rowwise: scales along rows for one GEMM and along columns for the other, so amax + cast
# twice = 10. rowwise_with_gw_hp: one rowwise cast per tensor (the weight gradient reads the bf16
# originals) = 5. Unfused upper bounds: compile fuses some casts into the ops before them.
CAST_BYTES = {"tensorwise": 7.0, "rowwise": 10.0, "rowwise_with_gw_hp": 5.0}
COPIES = {"tensorwise": 1, "rowwise": 2, "rowwise_with_gw_hp": 2}  # fp8 weight copies held forward to backward
FP8_FLOP_SHARE = {"tensorwise": 1.0, "rowwise": 1.0, "rowwise_with_gw_hp": 2.0 / 3.0}  # of a linear's FLOPs
SCALE_BYTES = 4
# rate of a recipe's scaled fp8 GEMMs relative to tensorwise's (one scale per operand): rowwise scales per
# row and column take slower kernels (CUTLASS, 2025), fitted on torchtitan's 70B rowwise run (FP8_FITTED in
# bench/published_runs.py; docs/planner.md)
RECIPE_RATE = {"tensorwise": 1.0, "rowwise": 0.54, "rowwise_with_gw_hp": 0.54}


@dataclass(frozen=True)
class Fp8:
    """dtype=fp8 as the planner times it: the recipe and the fp8 matmul rate over the bf16 one."""

    recipe: str
    speedup: float  # (peak_tflops_fp8 x fp8_matmul_efficiency) / (peak_tflops x matmul_efficiency); 1 emulated
    peak_flops: float | None  # the dense fp8 peak, FLOP/s (None: no FP8 units, emulated)
    min_features: int = 1024  # fp8.min_features: smaller layers stay bf16

    @property
    def float8_all_gather(self) -> bool:
        return self.recipe == "tensorwise"


def linears(fp8: Fp8, m: ModelConfig, tp: int) -> tuple[tuple[int, int], ...]:
    """(K, N) of the converted layers of one block, the mean over blocks (MoE blocks keep their MLP in bf16)."""
    dense = (m.n_layers - moe_layer_count(m)) / m.n_layers
    out = []
    for kind, (k, n) in block_linears(m).items():
        if fp8_layer(kind, k, n, fp8.min_features, tp) != "fp8":
            continue
        share = dense if kind.startswith("feed_forward") else 1.0  # the MLP's sharded side, by the dense share
        out.append((k, round(n * share)) if kind in COLUMN else (round(k * share), n))
    return tuple(out)


def converted_params(fp8: Fp8, m: ModelConfig, tp: int) -> int:
    """Weights of one block's converted layers (the mean over blocks)."""
    return sum(k * n for k, n in linears(fp8, m, tp))


def matmul_saving(fp8: Fp8, m: ModelConfig, tp: int, tokens: int, blocks: float, rate: float) -> float:
    """Seconds per microbatch the fp8 matmuls save over `blocks` block-equivalents (recomputed forwards
    counted) of `tokens` tokens each, whose linear FLOPs run at `rate` FLOP/s per device in bf16."""
    bf16 = 6.0 * converted_params(fp8, m, tp) * tokens * blocks / rate
    return bf16 * FP8_FLOP_SHARE[fp8.recipe] * (1.0 - 1.0 / fp8.speedup)


def cast_seconds(
    fp8: Fp8, m: ModelConfig, layout: Layout, tokens: int, blocks: float, bandwidth: float | None
) -> float:
    """Seconds per microbatch of the amax and cast passes over `blocks` block-equivalents (0 where the
    profile gives no memory bandwidth). Under the float8 all-gather each gather casts the local shard
    of a weight (forward and backward: 2 / fsdp_shard of it), else each forward casts the whole weight."""
    if not bandwidth:
        return 0.0
    weights = 2.0 / layout.fsdp_shard if fp8.float8_all_gather and layout.fsdp_shard > 1 else 1.0
    per_block = sum(tokens * (k + n) + weights * k * n for k, n in linears(fp8, m, layout.tp)) / layout.tp
    return CAST_BYTES[fp8.recipe] * per_block * blocks / bandwidth


def gathered_saving(fp8: Fp8 | None, m: ModelConfig, layout: Layout, layers: int, elem: int) -> float:
    """Bytes the float8 all-gather saves per gather of a rank's `layers` blocks (0 without it)."""
    if fp8 is None or not fp8.float8_all_gather:
        return 0.0
    return (elem - 1) * layers * converted_params(fp8, m, layout.tp) / layout.tp


def weight_bytes(fp8: Fp8, m: ModelConfig, layout: Layout, layers: int) -> float:
    """Bytes per device of the fp8 weight copies and scales of a rank's `layers` blocks."""
    shapes = linears(fp8, m, layout.tp)
    if fp8.recipe == "tensorwise":
        scales = SCALE_BYTES * len(shapes)
    else:
        scales = SCALE_BYTES * 2 * sum(k + n for k, n in shapes) / layout.tp
    copies = 0 if fp8.float8_all_gather and layout.fsdp_shard > 1 else COPIES[fp8.recipe]
    return layers * (copies * converted_params(fp8, m, layout.tp) / layout.tp + scales)
