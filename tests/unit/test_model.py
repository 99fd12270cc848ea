"""The model family, parameter counts and the FLOP formula against PyTorch's own counter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from launcher import flops
from launcher.config.model import ModelConfig
from launcher.model import Transformer
from launcher.model.init import initialized_model, meta_model, name_seed
from tests.conftest import make_config


def test_llama3_8b_has_exactly_8030261248_parameters_on_meta() -> None:
    cfg = make_config("+model=8b").model
    model = meta_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert flops.num_params(cfg) == 8_030_261_248
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny", "small", "125m", "1b", "70b", "405b", "gpt2-8.3b"])
def test_formula_counts_match_the_module(name: str) -> None:
    cfg = make_config(f"+model={name}").model
    assert flops.num_params(cfg) == sum(p.numel() for p in meta_model(cfg).parameters())


def test_gpt2_8_3b_is_megatrons_model() -> None:
    cfg = make_config("+model=gpt2-8.3b").model
    assert 8.2e9 < flops.num_params(cfg) < 8.4e9  # Shoeybi et al. 2019: "8.3B"
    model = meta_model(cfg)
    assert model.output.weight is model.tok_embeddings.weight and model.pos_embeddings is not None


VARIANTS = {
    "llama": {},
    "gpt2": {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "tied_embeddings": True, "bias": True},
    "post_norm_gqa": {"norm_position": "post", "n_kv_heads": 2},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_flops_formula_matches_flop_counter_within_2_percent(variant: str) -> None:
    cfg = dataclasses.replace(ModelConfig(), **VARIANTS[variant])
    model = Transformer(cfg)
    batch, seq = 2, 128
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    # the math backend runs attention as matmuls the counter sees (the fused CPU kernel is not counted)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    predicted = flops.flops_per_token(cfg, seq) * batch * seq
    assert counter.get_total_flops() == pytest.approx(predicted, rel=0.02)


def test_post_norm_has_no_final_norm_and_runs() -> None:
    cfg = dataclasses.replace(ModelConfig(), norm_position="post", n_layers=2)
    model = Transformer(cfg)
    assert model.norm is None
    assert model(torch.randint(0, 256, (1, 16))).shape == (1, 16, 256)


def initialized(cfg: ModelConfig, seed: int) -> Transformer:
    return initialized_model(cfg, seed, torch.device("cpu"))


def test_init_is_a_function_of_seed_and_name() -> None:
    a, b, c = initialized(ModelConfig(), 1), initialized(ModelConfig(), 1), initialized(ModelConfig(), 2)
    assert a.rope is not None and torch.equal(a.rope, Transformer(ModelConfig()).rope), "buffers are recomputed"
    values: dict[str, torch.Tensor] = {}
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
            values[name] = pa
    # one block more does not change the others' values (only the depth-scaled std of residual projections)
    deeper = initialized(dataclasses.replace(ModelConfig(), n_layers=5), 1)
    for name, p in deeper.named_parameters():
        if name in values and not name.endswith(("wo.weight", "w2.weight")):
            assert torch.equal(p, values[name]), name
    assert name_seed(1, "output.weight") == 0xA6F49C65F17E59EB, "a stable hash: the same in every process"


def test_init_draws_the_same_values_on_any_number_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks are drawn in parallel (torch's intra-op threads): the values are each block's own
    generator's, whatever the thread count; blocks smaller than a parameter, so a matrix is several."""
    from launcher.model import init

    monkeypatch.setattr(init, "BLOCK", 1000)  # the small model's matrices in many blocks each
    run_jobs, pieces = init.run_jobs, []

    def on(threads: int) -> torch.nn.Module:
        monkeypatch.setattr(init, "run_jobs", lambda jobs, _: (pieces.append(len(jobs)), run_jobs(jobs, threads)))
        return initialized(ModelConfig(), 3)

    one, four = on(1), on(4)
    assert pieces[0] > 100, pieces  # the work came in many pieces
    for (name, a), b in zip(one.named_parameters(), four.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tied_embeddings_stay_tied_after_materializing() -> None:
    model = initialized(dataclasses.replace(ModelConfig(), tied_embeddings=True), 1)
    assert model.output.weight is model.tok_embeddings.weight
