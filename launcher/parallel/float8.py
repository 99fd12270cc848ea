"""dtype=fp8: torchao's float8 training (`Float8Linear`) for the transformer blocks' linear layers.

Converted: attention's wq, wk, wv, wo and a dense MLP's w1, w2, w3, where both feature counts reach
`fp8.min_features` (smaller GEMMs spend more on the casts and amax passes than float8 saves) and
this rank's shard of each is a multiple of 16 (what float8 GEMMs take). High precision: the
embeddings and the output projection (the logits are sensitive, and the vocabulary GEMM is a small
share of the FLOPs), and MoE layers whole: the router, the shared experts and the routed experts,
whose grouped GEMM (launcher/ops/experts.py) is ours, not torchao's float8 one.

Where in the fixed order (launcher/parallel/__init__.py): right before the tensor-parallel plan, on
the meta model. The plan's forward hooks live on the module objects, so a layer swapped after the plan
would lose them; converted first, `ColwiseParallel` / `RowwiseParallel` shard the `Float8Linear`s
like any `nn.Linear`, and torchao casts the DTensor weights with one scale for the whole tensor
(amax all-reduced over the shards), so tp=2 computes what tp=1 does. Compile and FSDP2 come after.
Fused projections (launcher/ops/fused.py) run converted layers one by one.

FSDP2: with tensorwise scaling the weights are all-gathered in float8 (torchao's weight wrapper; on
gloo too, as bytes) and every layer's scale is precomputed in one pass after the optimizer step
(`precompute_scales`); rowwise recipes scale per row, so FSDP gathers their high-precision
weights and the cast follows the gather. The parameters stay the
high-precision master weights in either case: checkpoints and optimizer state are those of a bf16 run.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections import Counter
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from launcher.config.options import Fp8Options
from launcher.config.precision import COLUMN, ROW, fp8_layer
from launcher.model.moe import MoE
from launcher.ops.fused import autocast_input

MOE = "MoE layer: high precision (torchao's float8 grouped GEMM, CUDA only, is not used)"
# What torchao's import logs at WARNING (each logger, and a phrase of the one record dropped) that float8
# training never uses and no user can act on: its C++ and CUTLASS kernels (mxfp8, int4; float8 training
# runs on torch's own scaled matmul), Triton's int8 matmuls, and torch's deprecation of the way torchao
# registers its Enums for compile.
IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torchao", "Skipping import of cpp extensions"),
    ("torchao.kernel.intmm", "Detected no triton"),
    ("torch.utils._pytree", "Calling register_constant() on Enum subclasses is deprecated"),
)


class Dropped(logging.Filter):
    """A logger's records whose message contains `phrase`, dropped (the logger's others kept)."""

    def __init__(self, phrase: str) -> None:
        super().__init__()
        self.phrase = phrase

    def filter(self, record: logging.LogRecord) -> bool:
        return self.phrase not in record.getMessage()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dropped) and other.phrase == self.phrase

    __hash__ = logging.Filter.__hash__


def quiet_torchao() -> None:
    """Before torchao's first import in this process: IMPORT_NOISE dropped at its loggers."""
    for name, phrase in IMPORT_NOISE:
        logger = logging.getLogger(name)
        if Dropped(phrase) not in logger.filters:
            logger.addFilter(Dropped(phrase))


def decide(model: nn.Module, options: Fp8Options, tp: int) -> dict[str, str]:
    """Every linear layer of `model` (the whole meta model) by name: "fp8", or why it stays high
    precision; a MoE layer's router and routed experts (parameters, not `nn.Linear`s) too."""
    decisions = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            decisions[fqn] = _why(fqn, mod, options, tp)
        elif isinstance(mod, MoE):
            decisions |= {f"{fqn}.router": MOE, f"{fqn}.experts": MOE}
    return decisions


def _why(fqn: str, mod: nn.Linear, options: Fp8Options, tp: int) -> str:
    head, _, kind = fqn.partition(".")
    kind = kind.partition(".")[2]  # layers.N.attention.wq -> attention.wq
    if head != "layers":
        return "output projection" if fqn == "output" else "outside the blocks"
    if kind not in COLUMN + ROW:
        return MOE
    return fp8_layer(kind, mod.in_features, mod.out_features, options.min_features, tp)


def convert(part: nn.Module, decisions: dict[str, str], options: Fp8Options) -> None:
    """Swap `part`'s chosen `nn.Linear`s for torchao's `Float8Linear` (parameters and names unchanged)."""
    quiet_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(options.recipe),
        emulate=options.emulate,
        enable_fsdp_float8_all_gather=options.fsdp_float8_all_gather,
    )
    convert_to_float8_training(part, config=config, module_filter_fn=lambda _, fqn: decisions.get(fqn) == "fp8")
    for fqn, mod in part.named_modules():
        if decisions.get(fqn) == "fp8":
            mod.register_forward_pre_hook(_autocast_input)


def _autocast_input(mod: nn.Module, args: tuple) -> tuple | None:
    """The input in autocast's dtype, as `Float8Linear` casts it under CUDA autocast only: under a
    CPU's (dtype=fp8 with emulation) the high-precision gradient matmuls of rowwise_with_gw_hp
    would otherwise mix bf16 gradients with fp32 inputs."""
    return None if args[0].is_cuda else autocast_input(mod, args)


def precompute_scales(parts: list[nn.Module], options: Fp8Options | None) -> None:
    """FSDP2 with float8 all-gather: the weight scales for the next step, all layers in one pass;
    after every change to the weights (the optimizer step, a spike guard's rollback)."""
    if options is not None and options.fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)


def high_precision(tree: Any) -> Any:
    """A state dict (nested dicts and lists) with FSDP's float8 weight wrappers (torchao's
    `WeightWithDynamicFloat8CastTensor`, local shards of DTensors) replaced by the high-precision
    tensors they wrap, sharing their storage: checkpoints hold what a bf16 run's hold, and a load
    into this state writes the wrapped weights."""
    if "torchao" not in sys.modules:  # no float8 weights without torchao
        return tree
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if isinstance(tree, dict):
        return {key: high_precision(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [high_precision(value) for value in tree]
    if isinstance(tree, DTensor) and isinstance(tree._local_tensor, WeightWithDynamicFloat8CastTensor):
        local = tree._local_tensor._tensor
        return DTensor.from_local(
            local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape, stride=tree.stride()
        )
    return tree


def report(decisions: dict[str, str], options: Fp8Options) -> dict[str, Any]:
    """The summary's `fp8` entry: converted layers counted by kind, the rest by kind and reason."""
    kind = {fqn: fqn.split(".", 2)[2] if fqn.startswith("layers.") else fqn for fqn in decisions}
    converted = Counter(kind[f] for f, why in decisions.items() if why == "fp8")
    kept = Counter((kind[f], why) for f, why in decisions.items() if why != "fp8")
    return {
        "recipe": options.recipe,
        "emulate": options.emulate,
        "converted": dict(sorted(converted.items())),
        "high_precision": [{"layer": k, "count": n, "why": why} for (k, why), n in sorted(kept.items())],
        "fsdp_float8_all_gather": options.fsdp_float8_all_gather,  # FSDP2 layouts, tensorwise recipe
    }
