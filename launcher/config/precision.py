"""Which numbers a run computes in: one decision, from the dtype asked for, the device and the layout.

- fp32: dtype=fp32, or dtype=auto on a CPU (bf16 is slower than fp32 there without AMX).
- FSDP2 mixed precision on cuda where the layout shards with FSDP (dp_shard x cp > 1, HSDP included):
  `fully_shard` keeps the sharded fp32 parameters as the optimizer's master weights, all-gathers
  them in bf16 for compute and reduce-scatters gradients in fp32. Autocast around FSDP would gather
  fp32 (twice the traffic) and cast every weight again in every matmul.
- bf16 autocast everywhere else (one process, pure TP, DDP, and bf16 on a CPU): parameters and
  gradients stay fp32, matmuls run in bf16. No sharded gather to save there, and the same numbers
  as before on CPU.
- fp8 (launcher/parallel/float8.py): the blocks' large linear layers compute in float8 through
  torchao; everything else, master weights and optimizer state included, runs as bf16 does.

The decision needs no torch (`planner.resolve` takes it into BuildOptions.precision); the policy and
the autocast context that carry it out import torch when the runtime asks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.config.options import Fp8Options
from launcher.layout import Layout

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values

if TYPE_CHECKING:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from launcher.config.hardware import HardwareConfig
    from launcher.config.schema import Fp8Config


MODE_TEXT = {"fp32": "fp32", "fsdp_bf16": "bf16 (FSDP mixed precision)", "autocast_bf16": "bf16 autocast"}


def precision_text(mode: str, fp8: Fp8Options | None) -> str:
    """What a run computes in, for people (the run's first line, summary.json's `precision`): `fp32`,
    `bf16 autocast`, `fp8 (tensorwise, emulated) + bf16 autocast` (fp8's recipe, then the rest's mode)."""
    text = MODE_TEXT.get(mode, mode)
    if fp8 is None:
        return text
    return f"fp8 ({fp8.recipe}{', emulated' * fp8.emulate}) + {text}"


def precision_mode(dtype: str, kind: str, layout: Layout) -> str:
    """fp32 | fsdp_bf16 (FSDP2's MixedPrecisionPolicy) | autocast_bf16, for config `dtype` on `kind`."""
    cuda = kind == "cuda"
    if not (dtype in ("bf16", "fp8") or (dtype == "auto" and cuda)):
        return "fp32"
    return "fsdp_bf16" if cuda and layout.fsdp_shard > 1 else "autocast_bf16"


COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")  # out sharded by TP
ROW = ("attention.wo", "feed_forward.w2")  # in sharded by TP


def fp8_layer(kind: str, n_in: int, n_out: int, min_features: int, tp: int) -> str:
    """dtype=fp8's decision for one block linear (`kind`: COLUMN or ROW, features of the whole layer):
    "fp8", or why it stays high precision. The runtime converts by it (launcher/parallel/float8.py) and
    the planner prices by it (launcher/planner/fp8.py)."""
    if min(n_in, n_out) < min_features:
        return f"features below fp8.min_features={min_features}"
    local = (n_in, n_out // tp) if kind in COLUMN else (n_in // tp, n_out)
    if local[0] % 16 or local[1] % 16:
        return f"tp={tp} shard {local[0]}x{local[1]} not a multiple of 16"
    return "fp8"


def fp8_options(dtype: str, fp8: Fp8Config, hw: HardwareConfig, layout: Layout) -> Fp8Options | None:
    """dtype=fp8's options (None otherwise). FSDP2 gathers float8 weights with tensorwise scales (one
    scale per tensor, precomputed for all layers at once; gloo carries the float8 bytes too); rowwise
    recipes scale per row after the gather, so FSDP gathers their high-precision weights."""
    if dtype != "fp8":
        return None
    gather = fp8.recipe == "tensorwise" and layout.fsdp_shard > 1
    peak = (hw.peak_tflops_fp8 or 0.0) * 1e12
    return Fp8Options(fp8.recipe, fp8.emulate, fp8.min_features, fsdp_float8_all_gather=gather, peak_flops=peak)


def fsdp_policy(mode: str) -> MixedPrecisionPolicy | None:
    """The policy `fully_shard` gets (None: FSDP's default, parameters in their own dtype): bf16
    compute, fp32 gradient reduction; the sharded parameters (the master weights) stay fp32."""
    if mode != "fsdp_bf16":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def autocast_for(mode: str, device: torch.device) -> torch.autocast | None:
    """The autocast context the runner enters around forward (None: none)."""
    if mode != "autocast_bf16":
        return None
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16)
