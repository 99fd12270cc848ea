"""Document masking (data.document_mask): masks and positions at document and sequence edges, a packed
batch against each document run alone (per-token losses and gradients, tp=1, tp=2 and pp=2), the
FLOP count, and the combinations refused before any process starts."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from launcher import flops
from launcher.config.layout_keys import from_config
from launcher.config.model import ModelConfig
from launcher.config.schema import TrainConfig
from launcher.config.validate import validate
from launcher.data.documents import measured_span
from launcher.errors import LauncherError
from launcher.layout import build_mesh
from launcher.model.documents import attention_mask, dense_mask, document_ids, document_positions, masked_attention
from launcher.model.init import initialized_model
from launcher.parallel import build_runner
from launcher.planner import build_options
from launcher.planner.request import problem
from launcher.train.loop import train
from tests.conftest import assert_bad_input, run_cli, run_for, tiny_args, tiny_config
from tests.dist import run

EOS, VOCAB, SEQ = 0, 64, 16
# two sequences: documents cut by both sequence edges, an EOS as the first and as the last token,
# a one-token document (two EOS in a row)
TOKENS = torch.tensor(
    [
        [5, 6, 7, EOS, 8, 9, 10, 11, 12, EOS, 13, 14, 15, 16, 17, 18, 19],
        [EOS, 20, 21, EOS, EOS, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, EOS, 32],
    ]
)
ZB = {"pp": 2, "pp_schedule": "interleaved_zb", "virtual_stages": 2, "n_layers": 4}  # four stages, split passes
VARIANTS = {
    "llama": {"n_kv_heads": 2},  # RoPE, GQA
    "gpt2": {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "bias": True, "tied_embeddings": True},
}


def model_cfg(variant: str, n_layers: int = 2) -> ModelConfig:
    shape = {"dim": 32, "n_layers": n_layers, "n_heads": 4, "ffn_dim": 64, "vocab_size": VOCAB, "max_seq_len": SEQ}
    return ModelConfig(name="docs", **shape, **VARIANTS[variant])


def test_documents_restart_after_every_eos_and_at_the_sequence_start() -> None:
    docs = document_ids(TOKENS[:, :-1], EOS)
    assert docs[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert docs[1].tolist() == [0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    positions = document_positions(docs)
    assert positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert positions[1].tolist() == [0, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    mask = dense_mask(docs)[:, 0]
    assert mask[1, 4].tolist() == [False] * 4 + [True] + [False] * 11  # the lone EOS sees itself only
    assert mask[0, 4, :4].sum() == 0 and mask[0, 9, 4:10].all() and not mask[0, 3, 4:].any()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_matches_the_dense_mask() -> None:
    """The CUDA path's block mask gives the CPU path's outputs (flex runs forward only on a CPU)."""
    docs = document_ids(TOKENS[:, :-1], EOS)
    q, k, v = (torch.randn(2, 4, SEQ, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    dense = masked_attention(q, k, v, attention_mask(docs, flex=False), 0.0)
    flex = masked_attention(q, k, v, attention_mask(docs, flex=True), 0.0)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


MASK_PEAK = """
import resource, sys, torch
from launcher.model.documents import block_mask
seq, compiled = 16384, sys.argv[1] == "compiled"
if compiled:  # compiled once per shape, first
    block_mask(torch.zeros(1, seq, dtype=torch.long), compiled)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = block_mask((torch.arange(seq) // 1000)[None], compiled)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024, mask.kv_num_blocks.sum().item())
"""


def test_the_cuda_block_mask_is_built_block_by_block() -> None:
    """The CUDA path's block mask is built compiled (`block_mask`'s default there): eager evaluates the rule
    for every (query, key) pair at once, (batch, seq, seq) int64 tensors; compiled, block by block. Each
    build in a fresh process, the peak memory it adds (compiled: after the shape's first call, which compiles)."""
    grown = {}
    for how in ("compiled", "eager"):
        out = subprocess.run([sys.executable, "-c", MASK_PEAK, how], capture_output=True, text=True, check=True)
        grown[how] = [int(x) for x in out.stdout.split()]
    assert grown["compiled"][1] == grown["eager"][1]  # the same visible blocks
    assert grown["eager"][0] >= 256 and grown["compiled"][0] < 64, grown  # MiB the build added


def alone_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Each document of each sequence run by itself, plain causal, logits put back in sequence order."""
    rows = []
    for row, docs in zip(tokens, document_ids(tokens, EOS)):
        pieces = [model(row[docs == d][None]) for d in docs.unique()]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def reference(variant: str, n_layers: int = 2) -> dict[str, Any]:
    """Per-token losses and the gradients of their mean, every document run alone (one process)."""
    model = initialized_model(model_cfg(variant, n_layers), 3, torch.device("cpu"))
    x, y = TOKENS[:, :-1], TOKENS[:, 1:]
    losses = F.cross_entropy(alone_logits(model, x).flatten(0, 1), y.flatten(), reduction="none")
    losses.mean().backward()
    return {"losses": losses.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_batch_equals_each_document_alone(variant: str) -> None:
    model = initialized_model(model_cfg(variant), 3, torch.device("cpu"))
    x, y = TOKENS[:, :-1], TOKENS[:, 1:]
    docs = document_ids(x, EOS)  # a forward input, as the runner passes it: the model holds no EOS
    losses = F.cross_entropy(model(x, documents=docs).flatten(0, 1), y.flatten(), reduction="none")
    losses.mean().backward()
    ref = reference(variant)
    torch.testing.assert_close(losses.detach(), ref["losses"], rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad()
    chunked = model(x, y, docs)  # the chunked loss path the single-process runner takes
    torch.testing.assert_close(chunked, ref["losses"].mean(), rtol=1e-5, atol=1e-6)


def layout_cfg(variant: str, n_layers: int = 2, **degrees: Any) -> TrainConfig:
    cfg = TrainConfig(
        model=model_cfg(variant, n_layers), seq_len=SEQ, seed=3, batch={"micro": 1, "global": 2}, **degrees
    )
    return replace(cfg, data=replace(cfg.data, name="tokens", document_mask=True, eos_id=EOS))


def packed_case(rank: int, world: int, variant: str, degrees: dict[str, Any]) -> dict[str, Any]:
    """The packed batch through `parallelize`'s runner on this rank: mean loss, whole gradients."""
    cfg = layout_cfg(variant, **degrees)
    layout = from_config(cfg, world)
    options = build_options(cfg, layout)
    runner = build_runner(cfg.model, layout, build_mesh(layout, "cpu"), options, torch.device("cpu"))
    local = TOKENS.shape[0] // layout.dp
    rows = TOKENS[layout.coordinates(rank)["dp"] * local :][:local]
    loss = runner.forward_backward(rows[:, :-1], rows[:, 1:])
    grads = {}
    for part in runner.parts:
        for name, p in part.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return {"loss": loss, "grads": grads}


@pytest.mark.slow
@pytest.mark.parametrize(
    "degrees",
    [
        {"tp": 2},
        {"tp": 2, "sequence_parallel": True, "recompute": "selective"},
        {"pp": 2, "pp_schedule": "gpipe"},
        {"dp": 2},
        ZB,
    ],
    ids=["tp2", "tp2-sp-selective", "pp2", "fsdp2", "pp2-interleaved-zb"],
)
def test_parallel_packed_batch_equals_each_document_alone(degrees: dict[str, Any]) -> None:
    """Heads split over tp ranks share the mask; later pipeline stages get the document ids; FSDP
    ranks each mask their own sequences."""
    results = run(packed_case, 2, "llama", degrees)
    ref = reference("llama", degrees.get("n_layers", 2))
    for result in results:
        assert result["loss"] == pytest.approx(ref["losses"].mean().item(), rel=1e-5)
    grads = {n: g for result in results for n, g in result["grads"].items()}
    assert set(grads) == set(ref["grads"])
    for name, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


def test_flops_follow_the_documents(tmp_path: Path) -> None:
    """Attention work is the sum of squared document lengths: seq_len only for documents as long."""
    assert flops.document_span([4, 4, 8], 8) == pytest.approx((16 + 16 + 64) / 16)
    assert flops.document_span([100], 8) == 8
    tokens = np.array([1, 2, EOS, 3, 4, 5, EOS, 6], dtype=np.uint16)
    assert measured_span(tokens, EOS, 16) == pytest.approx((9 + 16) / 7)  # whole documents only
    docs = ("data=tokens", "data.document_mask=true", "data.eos_id=0")
    assert problem(tiny_config(tmp_path, *docs, "data.document_len=4"), 1).span == 4
    assert problem(tiny_config(tmp_path, *docs), 1).span == 32  # document_len 2048 > seq_len: no saving
    assert problem(tiny_config(tmp_path), 1).span == 0.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, "data.document_mask=true with data=stdlib"),
        ({"name": "tokens"}, "data.document_mask=true with data=tokens: set data.eos_id=ID"),
        ({"name": "tokens", "eos_id": 99999}, "data.eos_id=99999 is beyond model.vocab_size"),
        ({"name": "mix", "sources": [{"name": "stdlib", "weight": 1}]}, r"with data.sources\[0\] data=stdlib"),
    ],
)
def test_sources_without_document_ends_are_refused(tmp_path: Path, overrides: dict, expected: str) -> None:
    cfg = tiny_config(tmp_path)
    cfg = replace(cfg, data=replace(cfg.data, document_mask=True, **overrides))
    with pytest.raises(LauncherError, match=expected):
        validate(cfg)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [({"cp": 2}, "cp=2 with data.document_mask=true"), ({"dropout": 0.1}, "model.dropout=0.1 with data.document_mask")],
)
def test_unsupported_layouts_are_refused(keys: dict, expected: str) -> None:
    cfg = layout_cfg("llama")
    if "dropout" in keys:
        cfg = replace(cfg, model=replace(cfg.model, dropout=keys["dropout"]))
    else:
        cfg = replace(cfg, **keys)
    with pytest.raises(LauncherError, match=expected):
        validate(cfg)


@pytest.mark.slow
def test_train_refuses_in_one_line_before_spawn(tmp_path: Path) -> None:
    args = [*tiny_args(tmp_path / "cache"), "data.document_mask=true", "steps=1"]
    assert_bad_input(run_cli("train", *args, cwd=tmp_path), "data.document_mask=true with data=stdlib", tmp_path)


@pytest.mark.slow
def test_tiny_run_trains_with_document_masks(tmp_path: Path) -> None:
    """data=tokens with document ends: the run trains, its model FLOPs count the documents' span."""
    tokens = np.random.default_rng(0).integers(1, 200, 20_000).astype(np.uint16)
    tokens[::10] = EOS  # nine-token documents
    path = tmp_path / "docs.bin"
    tokens.tofile(path)
    cfg = tiny_config(tmp_path, "data=tokens", f"data.path={path}", "data.document_mask=true", f"data.eos_id={EOS}")
    summary = train(run_for(cfg), tmp_path / "run")
    span = measured_span(tokens[: tokens.size - int(tokens.size * cfg.data.val_fraction)], EOS, cfg.seq_len)
    assert summary["flops_per_token"] == pytest.approx(flops.flops_per_token(cfg.model, span))
    assert span == pytest.approx(10, rel=0.01)


def token_file(path: Path, doc_len: int, eos: int = EOS) -> np.ndarray:
    tokens = np.random.default_rng(doc_len).integers(1, 200, 20_000).astype(np.uint16)
    tokens[::doc_len] = eos
    tokens.tofile(path)
    return tokens


def mixture(tmp_path: Path, eos: tuple[int, int] = (EOS, EOS)) -> list[str]:
    """Two token files of 9- and 19-token documents, at shares 1/4 and 3/4."""
    paths = [tmp_path / "short.bin", tmp_path / "long.bin"]
    token_file(paths[0], 10), token_file(paths[1], 20)
    sources = ", ".join(
        f"{{name: tokens, path: '{path}', weight: {w}, eos_id: {e}}}" for path, w, e in zip(paths, (1, 3), eos)
    )
    return ["data=mix", f"data.sources=[{sources}]", "data.document_mask=true"]


@pytest.mark.slow
def test_a_mixture_masks_documents_and_counts_its_sources_spans(tmp_path: Path) -> None:
    """Every source ends documents in one id; the model FLOPs follow the spans weighted by the shares."""
    cfg = tiny_config(tmp_path, *mixture(tmp_path))
    summary = train(run_for(cfg), tmp_path / "run")
    trains = [np.fromfile(tmp_path / name, np.uint16) for name in ("short.bin", "long.bin")]
    trains = [t[: t.size - int(t.size * cfg.data.val_fraction)] for t in trains]
    span = 0.25 * measured_span(trains[0], EOS, cfg.seq_len) + 0.75 * measured_span(trains[1], EOS, cfg.seq_len)
    assert span == pytest.approx(0.25 * 10 + 0.75 * 20, rel=0.02)
    assert summary["flops_per_token"] == pytest.approx(flops.flops_per_token(cfg.model, span), rel=1e-3)


def test_a_mixture_whose_sources_end_documents_differently_is_refused(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, *mixture(tmp_path, eos=(EOS, EOS + 1)))
    with pytest.raises(LauncherError, match="the sources end documents with different ids"):
        build_options(cfg, from_config(cfg, 1))
