"""Parallel runs match the single-process run: the initial weights bit for bit, the loss of each of
5 steps and the gradients after step 1 (fp32, rtol 1e-4), for every layout in CASES, with
pre-norm + RMSNorm and post-norm + LayerNorm models. And under tensor parallelism the full logits
never exist on one rank.

Process starts dominate on 2 cores, so all cases of both model variants run in two launches: first
two 2-rank worlds side by side, then one 4-rank world, each running its cases one after another.
Each case builds its own DeviceMesh on the world's process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from launcher.config.layout_keys import from_config
from launcher.config.model import ModelConfig
from launcher.config.schema import FSDPConfig, OptimConfig, TrainConfig
from launcher.data.context_split import split_sequence
from launcher.layout import build_mesh
from launcher.parallel import build_runner
from launcher.planner import build_options
from launcher.train.optim import build_optimizer
from tests.conftest import selected_cases
from tests.dist import run_many

pytestmark = pytest.mark.slow

STEPS, SEQ, GLOBAL_BATCH, VOCAB = 5, 16, 8, 256

VARIANTS = {  # every architecture switch the plan has to handle appears in one of the two
    "pre-rmsnorm": dict(norm="rmsnorm", norm_position="pre", mlp="swiglu", positions="rope", n_kv_heads=2),
    "post-layernorm": dict(norm="layernorm", norm_position="post", mlp="gelu", positions="learned", bias=True),
}

CASES = {  # name: layout and parallelism keys
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2-gpipe": dict(pp=2, pp_schedule="gpipe"),
    "pp2-interleaved": dict(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
    "dp2-ddp": dict(dp=2, dp_shard=1, batch={"micro": 2, "global": 8}),  # 2 micro-batches: sync on the last
    "dp2-fsdp": dict(dp=2, batch={"micro": 2, "global": 8}),
    "pp2-1f1b": dict(pp=2, pp_schedule="1f1b"),
    "tp2-recompute": dict(tp=2, recompute="selective"),
    "tp2-tied": dict(tp=2, model=dict(tied_embeddings=True)),
    "pp2-uneven": dict(pp=2, model=dict(n_layers=3)),  # stages hold layers 0-1 and 2
    "tp2-dp2-ddp": dict(tp=2, dp=2, dp_shard=1),
    "tp2-dp2-fsdp": dict(tp=2, dp=2),
    "tp2-pp2": dict(tp=2, pp=2, pp_schedule="1f1b"),
    "tp2-sp-dp2-fsdp": dict(tp=2, dp=2, sequence_parallel=True, recompute="full"),
    "dp2-pp2-fsdp": dict(dp=2, pp=2, batch={"micro": 2, "global": 8}),  # 2 microbatches per dp rank
    "dp2-pp2-ddp": dict(dp=2, dp_shard=1, pp=2, pp_schedule="gpipe", batch={"micro": 2, "global": 8}),
    "hsdp2x2": dict(dp=4, dp_replicate=2, dp_shard=2, batch={"micro": 1, "global": 8}),  # 2: all-reduce on the last
    "dp2-zero2": dict(dp=2, fsdp=FSDPConfig(reshard_after_forward="never"), batch={"micro": 2, "global": 8}),
    "tp2-selective-layers1": dict(tp=2, recompute="selective", recompute_layers=1),  # block 0 full, 1-3 selective
    "pp2-layers1": dict(pp=2, recompute_layers=1),  # each stage: its first block full, the other none
    "tp2-dp2-zero2": dict(tp=2, dp=2, fsdp=FSDPConfig(reshard_after_forward="never")),
    "dp2-pp2-zero3": dict(dp=2, pp=2, fsdp=FSDPConfig(reshard_after_forward="always"), batch={"micro": 2, "global": 8}),
}
# what runs where: two 2-rank worlds side by side, then one 4-rank world
LAUNCHES = [
    [
        (2, ["tp2", "tp2-sp", "pp2-gpipe", "pp2-interleaved", "tp2-tied", "dp2-zero2", "tp2-selective-layers1"]),
        (2, ["dp2-ddp", "dp2-fsdp", "pp2-1f1b", "tp2-recompute", "pp2-uneven", "pp2-layers1"]),
    ],
    [
        (
            4,
            [
                "tp2-dp2-ddp",
                "tp2-dp2-fsdp",
                "tp2-pp2",
                "tp2-sp-dp2-fsdp",
                "dp2-pp2-fsdp",
                "dp2-pp2-ddp",
                "hsdp2x2",
                "tp2-dp2-zero2",
                "dp2-pp2-zero3",
            ],
        )
    ],
]
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
PROBED = ("tp2", "tp2-sp")  # the cases whose materialized tensors and collectives are recorded
RECORDED = (*PROBED, "dp2-fsdp", "dp2-zero2", "tp2-selective-layers1")  # recorded too


def make_cfg(variant: str, case: dict[str, Any] | None = None) -> TrainConfig:
    """The case's config; without layout keys, the single-process reference of the same model."""
    keys = dict(case or {})
    model = ModelConfig(
        name="test", dim=32, n_layers=4, n_heads=4, ffn_dim=64, vocab_size=VOCAB, max_seq_len=64, **VARIANTS[variant]
    )
    model = replace(model, **keys.pop("model", {}))
    optim = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.5)
    cfg = TrainConfig(model=model, optim=optim, steps=STEPS, seq_len=SEQ, seed=7, batch={"micro": 4, "global": 8})
    return replace(cfg, **keys)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


class ShapeRecorder(TorchDispatchMode):
    """Shapes of every tensor an op materializes on this rank (a DTensor's local shard), and the
    collectives it issues: (name, elements of the input), forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()
        self.collectives: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            self.collectives.append((name, args[0].numel()))
        if func.namespace == "c10d" and name == "_allgather_base_":  # FSDP2's parameter all-gather
            self.collectives.append((name, args[1].numel()))
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple((t._local_tensor if isinstance(t, DTensor) else t).shape))
        return out


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train_case(
    cfg: TrainConfig, world_size: int, probe: bool = False, each_step: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """The case on this rank (world_size 1: the reference): losses, gradients after step 1;
    `each_step(runner)` after every optimizer step (what a caller records beyond these)."""
    layout = from_config(cfg, world_size)
    mesh = build_mesh(layout, "cpu") if world_size > 1 else None
    runner = build_runner(cfg.model, layout, mesh, build_options(cfg, layout), torch.device("cpu"))
    optimizer, schedule = build_optimizer(runner.parts, cfg.optim, cfg.steps)
    coords = layout.coordinates(torch.distributed.get_rank()) if mesh is not None else {"dp": 0, "cp": 0}
    local = GLOBAL_BATCH // layout.dp
    losses, norms, grads, recorder = [], [], {}, ShapeRecorder()
    weights = {n: full(p) for part in runner.parts for n, p in part.named_parameters()}
    for step in range(1, cfg.steps + 1):
        x, y = (split_sequence(t[coords["dp"] * local :][:local], layout.cp, coords["cp"]) for t in batch(step))
        if probe and step == 1:
            with recorder:
                losses.append(runner.forward_backward(x, y))
        else:
            losses.append(runner.forward_backward(x, y))
        if step == 1:
            grads = {n: full(p.grad) for part in runner.parts for n, p in part.named_parameters()}
        norms.append(runner.clip_grad_norm(cfg.optim.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if each_step is not None:
            each_step(runner)
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "weights": weights,
        "shapes": recorder.shapes,
        "collectives": recorder.collectives,
    }


def run_cases(rank: int, world_size: int, keys: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    return {
        (variant, name): train_case(make_cfg(variant, CASES[name]), world_size, probe=name in RECORDED)
        for variant, name in keys
    }


@pytest.fixture(scope="module")
def parallel_results(request: pytest.FixtureRequest) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Per (variant, case): what each rank returned."""
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    wanted = selected_cases(request, variant=VARIANTS, case=CASES)
    for launch in LAUNCHES:
        worlds = [(n, [(v, name) for v, name in wanted if name in names]) for n, names in launch]
        jobs = [(run_cases, n, (keys,)) for n, keys in worlds if keys]
        for per_rank in run_many(jobs, timeout=300):
            for key in per_rank[0]:
                results[key] = [r[key] for r in per_rank]
    return results


@pytest.fixture(scope="module")
def references(request: pytest.FixtureRequest) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (variant, model keys of the case): the single-process run."""
    refs = {}
    for variant, name in selected_cases(request, variant=VARIANTS, case=CASES):
        case = CASES[name]
        key = (variant, repr(case.get("model")))
        if key not in refs:
            refs[key] = train_case(make_cfg(variant, {"model": case.get("model", {})}), 1, probe=True)
    return refs


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(parallel_results: dict, references: dict, variant: str, case: str) -> None:
    ref, ranks = references[variant, repr(CASES[case].get("model"))], parallel_results[variant, case]
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(
            result["losses"], ref["losses"], rtol=1e-4, atol=0, msg=lambda m, r=rank: f"rank {r} losses: {m}"
        )
        torch.testing.assert_close(
            result["norms"], ref["norms"], rtol=1e-4, atol=0, msg=lambda m, r=rank: f"rank {r} grad norms: {m}"
        )
    grads: dict[str, torch.Tensor] = {}
    for result in ranks:  # each rank reports its stage's parameters, gathered whole
        grads.update(result["grads"])
        for name, weight in result["weights"].items():  # the same initial model, bit for bit
            torch.testing.assert_close(weight, ref["weights"][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert sorted(grads) == sorted(ref["grads"])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_logits_never_materialized_under_tp(parallel_results: dict, references: dict, variant: str) -> None:
    micro = make_cfg(variant).batch["micro"]
    full_logits = {(micro, SEQ, VOCAB), (micro * SEQ, VOCAB)}
    reference = references[variant, repr(CASES["tp2"].get("model"))]
    assert full_logits & reference["shapes"], "the recorder must see the logits of the reference run"
    for rank, result in enumerate(parallel_results[variant, "tp2"]):
        seen = {s for s in result["shapes"] if s and s[-1] == VOCAB}
        assert not seen, f"rank {rank} materialized tensors with the full vocabulary: {sorted(seen)}"
        assert (micro * SEQ, VOCAB // 2) in result["shapes"], "each rank holds its vocabulary shard of the logits"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", PROBED)
def test_tp_ranks_meet_once_per_half_block(parallel_results: dict, variant: str, case: str) -> None:
    """Megatron's cut: one collective of the activations after attention and one after the MLP, and
    one each for their input gradients in backward (4 per layer), plus the vocabulary-parallel
    embedding (forward) and output projection (backward). With sequence parallelism each all-reduce
    becomes an all-gather and a reduce-scatter; the count is the same for both. Per microbatch."""
    cfg = make_cfg(variant, CASES[case])
    full = cfg.batch["micro"] * SEQ * cfg.model.dim  # elements of the (micro, seq, dim) activations
    expected = (4 * cfg.model.n_layers + 2) * cfg.batch["global"] // cfg.batch["micro"]
    for rank, result in enumerate(parallel_results[variant, case]):
        ops = [name for name, numel in result["collectives"] if numel in (full, full // 2)]
        counted = {name: ops.count(name) for name in sorted(set(ops))}
        if case == "tp2":
            assert counted == {"all_reduce": expected}, f"rank {rank}: {counted}"
        else:
            assert counted == {"all_gather_into_tensor": expected, "reduce_scatter_tensor": expected}, (
                f"rank {rank}: {counted}"
            )


@pytest.mark.parametrize("variant", VARIANTS)
def test_selective_recompute_repeats_no_collective(parallel_results: dict, variant: str) -> None:
    """Op-level selective recompute saves the all-reduce that ends each row-parallel matmul: only the
    block recomputed in full (recompute_layers=1) repeats its forward all-reduces in backward. Both
    under post-norm; under pre-norm only the attention's: torch's (non-reentrant) checkpoint stops
    recomputing once the last tensor backward needs is rebuilt, and the MLP's output projection and
    its all-reduce only feed the residual add."""
    cfg = make_cfg(variant, CASES["tp2-selective-layers1"])
    full = cfg.batch["micro"] * SEQ * cfg.model.dim
    repeated = 1 if cfg.model.norm_position == "pre" else 2
    expected = (4 * cfg.model.n_layers + 2 + repeated) * cfg.batch["global"] // cfg.batch["micro"]
    for rank, result in enumerate(parallel_results[variant, "tp2-selective-layers1"]):
        ops = [name for name, numel in result["collectives"] if numel == full]
        assert ops.count("all_reduce") == expected, f"rank {rank}: {ops.count('all_reduce')} all-reduces"


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero2_gathers_once_per_microbatch(parallel_results: dict, variant: str) -> None:
    """ZeRO-3 gathers each FSDP unit (every block and the root) for forward and again for backward;
    ZeRO-2 keeps it from one to the other: one gather per unit and microbatch."""
    units, microbatches = make_cfg(variant).model.n_layers + 1, 2
    for zero3, zero2 in zip(parallel_results[variant, "dp2-fsdp"], parallel_results[variant, "dp2-zero2"]):
        g3, g2 = (sum(name == "_allgather_base_" for name, _ in r["collectives"]) for r in (zero3, zero2))
        assert (g3, g2) == (2 * units * microbatches, units * microbatches)
