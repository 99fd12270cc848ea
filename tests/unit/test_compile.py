"""The compiled path, judged by the compiler itself: every block kind the launcher builds, cut and
wrapped by the real `shard_model` (tensor parallelism with sequence parallelism and FSDP on a fake
process group of two ranks), compiled by it with the `aot_eager` backend (dynamo's graphs and breaks
are those a GPU gets; only inductor's kernels are left out), and one forward and backward of the whole
model part: one graph per compiled unit and no graph break, under every recompute policy.

Compiled and eager agree (one process, loss and gradients), so the plain chains the compiler traces
(launcher/ops/pointwise.py) are the eager nodes' maths.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.compat.compile_compat import reset_compile_counts
from launcher.compat.torch_compat import fake_store
from launcher.config.layout_keys import from_config
from launcher.layout import build_mesh
from launcher.model.init import materialize, meta_model
from launcher.parallel import shard_model
from launcher.parallel.compiled import CompileReport
from launcher.planner import build_options
from launcher.train.loop import train
from tests.conftest import run_for, tiny_config

KINDS = {
    "dense": [],
    "gpt2": ["model.positions=learned", "model.mlp=gelu", "model.norm=layernorm", "model.bias=true"],
    "post-norm": ["model.norm_position=post"],
    "tied": ["model.tied_embeddings=true"],
    "moe": ["model=moe_tiny"],
    "documents": ["data.document_mask=true"],
    "fp8": ["dtype=fp8", "fp8.emulate=true", "fp8.min_features=16"],
}
LAYOUTS = {"one": [], "tp2-sp": ["tp=2", "sequence_parallel=true"], "dp_shard2": ["dp_shard=2"]}
RECOMPUTE = ["none", "selective", "full"]
SEQ, MICRO = 16, 2


def build(tmp_path: Path, *keys: str, backend: str = "aot_eager") -> tuple[list, torch.Tensor, int]:
    """This rank's model parts as `train` builds them with compile on (`backend`), on the CPU: parts,
    a batch of tokens and the units compiled. A world of more than one rank runs on the fake group."""
    cfg = tiny_config(tmp_path, "compile=true", f"seq_len={SEQ}", f"batch.micro={MICRO}", *keys)
    world = cfg.tp * cfg.dp_shard if isinstance(cfg.dp_shard, int) else cfg.tp
    layout = from_config(cfg, world)
    options = replace(build_options(cfg, layout), compile_backend=backend)
    mesh = None
    if world > 1:
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
        mesh = build_mesh(layout, "cpu")
    parts, _ = shard_model(meta_model(cfg.model), layout, options, mesh)
    materialize(parts, cfg.seed, torch.device("cpu"))
    tokens = torch.randint(0, cfg.model.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return parts, tokens, cfg.model.n_layers * (3 if "model=moe_tiny" in keys else 1)


@pytest.fixture(autouse=True)
def fresh_compiler():
    reset_compile_counts()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_compile_counts()


def step(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_block_compiles_to_one_graph(kind: str, layout: str, recompute: str, tmp_path: Path) -> None:
    if layout != "one" and kind not in ("dense", "moe", "fp8"):
        pytest.skip("the kinds' differences are inside the block: one process covers them")
    [model], tokens, units = build(tmp_path, *KINDS[kind], *LAYOUTS[layout], f"recompute={recompute}")
    if kind == "moe" and layout != "one" and recompute == "full":
        # the fake group's collectives return uninitialized memory, so a full recompute of the block
        # routes its tokens anew, differently, and the checkpoint refuses it (torch 2.11); the graphs and
        # breaks are decided at the first forward (AOT autograd traces forward and backward there)
        model(tokens[:, :-1], tokens[:, 1:])
    else:
        step(model, tokens)
    report = CompileReport.now(units)
    assert report.breaks == {}, report.line()
    # identical blocks share a graph; MoE's norms and attention are graphs of their own
    assert 1 <= report.graphs <= units, report.line()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_compute_what_eager_does(recompute: str, tmp_path: Path) -> None:
    keys = ("model.dropout=0", f"recompute={recompute}")
    [eager], tokens, _ = build(tmp_path, "compile=false", *keys)
    [compiled], _, _ = build(tmp_path, *keys)
    loss_eager, loss_compiled = step(eager, tokens), step(compiled, tokens)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_run_says_what_compile_did(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tiny_config(tmp_path, "compile=true", "steps=2", "recompute=selective", "metrics.console=plain")
    run = run_for(cfg)
    run = replace(run, options=replace(run.options, compile_backend="aot_eager"))
    summary = train(run, tmp_path / "run")
    assert summary["compiled"] == {"units": 2, "graphs": 1, "graph_breaks": 0, "break_reasons": {}}
    assert "compile: 2 modules compiled into 1 graph, no graph break" in capsys.readouterr().out


MOVED: dict[str, set[torch.dtype]] = {}  # collective → dtypes it moves, filled by the recording backend


def record_collectives(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A compiler for AOT autograd's forward and backward graphs that notes their collectives' dtypes."""
    from functorch.compile import make_boxed_func

    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and name.startswith("_c10d_functional.") and "wait" not in name:
            MOVED.setdefault(name.split(".")[1], set()).add(node.args[0].meta["val"].dtype)
    return make_boxed_func(gm.forward)


def collectives_in_compiled_graphs(tmp_path: Path, *keys: str) -> dict[str, set[torch.dtype]]:
    """The dtypes each functional collective moves in the compiled blocks' forward and backward graphs
    (AOT autograd's, as inductor receives them), after one step under bf16 autocast at tp=2 + SP."""
    from torch._dynamo.backends.common import aot_autograd

    if "record_collectives" not in torch._dynamo.list_backends(exclude_tags=()):
        backend = aot_autograd(fw_compiler=record_collectives, bw_compiler=record_collectives)
        torch._dynamo.register_backend(backend, "record_collectives")
    MOVED.clear()
    [model], tokens, _ = build(tmp_path, "tp=2", "sequence_parallel=true", *keys, backend="record_collectives")
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return dict(MOVED)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_sequence_parallel_gathers_what_the_matmul_reads(recompute: str, tmp_path: Path) -> None:
    """Under bf16 autocast the residual stream is fp32; a block's all-gather (and its backward's
    reduce-scatter) must move bf16, the matmul's input dtype, with no cast between gather and matmul:
    half the bytes, and the pattern inductor's async-TP pass fuses into one all-gather-matmul."""
    moved = collectives_in_compiled_graphs(tmp_path, "dtype=bf16", f"recompute={recompute}")
    assert moved.get("all_gather_into_tensor") == {torch.bfloat16}, moved
    assert moved.get("reduce_scatter_tensor") == {torch.bfloat16}, moved
