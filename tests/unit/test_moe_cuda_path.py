"""The experts on the CUDA path (FSDP2's bf16 policy) where one rank holds each (edp = 1): they stay in an FSDP unit
of that one rank, whose bf16 copy is freed after forward, rather than cast by the layer itself and saved by every
micro-batch in flight (launcher/parallel/expert.py `shard_experts`); and the step still matches one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from launcher.compat import torch_compat as compat
from launcher.config.layout_keys import from_config
from launcher.config.model import ModelConfig, MoEConfig
from launcher.config.schema import TrainConfig
from launcher.layout import build_mesh, expert_mesh
from launcher.model.init import meta_model
from launcher.parallel import shard_model
from launcher.parallel.expert import moe_layers
from launcher.planner import build_options
from tests.dist import run
from tests.unit.test_cuda_path import CPU, CUDA, make_cfg, train_losses

# balanced routing: bf16's rounding cannot flip a token's experts between the runs compared
MOE = ModelConfig(
    name="test", dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64,
    moe=MoEConfig(experts=4, top_k=2, expert_ffn_dim=32, force_balance=True),
)  # fmt: skip


def moe_cfg(hardware: object, **keys: object) -> TrainConfig:
    return replace(make_cfg(hardware, **keys), model=MOE)


@pytest.mark.parametrize(("hardware", "unit"), [(CUDA, True), (CPU, False)], ids=["bf16-policy", "no-cast"])
def test_experts_of_one_rank_stay_in_fsdp_where_its_policy_casts(hardware: object, unit: bool) -> None:
    """ep=2 over dp_shard=2 (edp = 1), rank 1 of a fake world: under the bf16 policy each layer's experts are an
    FSDP unit of their own; with nothing to cast they stay out of FSDP and divide their gradients themselves."""
    cfg = moe_cfg(hardware, ep=2, compile=False)
    layout = from_config(cfg, 2)
    dist.init_process_group("fake", store=compat.fake_store(), rank=1, world_size=2)
    try:
        mesh = build_mesh(layout, "cpu")
        parts, _ = shard_model(meta_model(cfg.model), layout, build_options(cfg, layout), mesh, expert_mesh(layout))
    finally:
        dist.destroy_process_group()
    layers = moe_layers(parts)
    assert len(layers) == 2 and layout.edp == 1
    assert {isinstance(moe.experts, FSDPModule) for moe in layers} == {unit}
    assert {moe.experts.grad_divide for moe in layers} == {1.0 if unit else 2.0}


@pytest.mark.slow
def test_experts_of_one_rank_under_the_bf16_policy_match_autocast_within_bf16() -> None:
    """ep=2 x pp=2 x dp=2 (edp = 1, two micro-batches in flight on the first stage) with the cuda profile's choices,
    on CPU tensors over gloo, against one process with bf16 autocast."""
    reference = train_losses(0, 1, moe_cfg(CPU, dtype="bf16"))
    for result in run(train_losses, 4, moe_cfg(CUDA, compile=False, ep=2, pp=2, dp=2)):
        assert result["impl"] == "fused"
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-3)
