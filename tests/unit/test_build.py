"""Building a big model never puts the whole of it on a rank, and `steps=0` stops after building.

The memory test counts, in each worker, the bytes of the storages that ops create on a real device
and are still alive, with a dispatch mode that checks every factory call (torch.empty, randn, ...)
*before* it allocates: a build that would hold more than the rank's shards plus one full parameter
fails by this test's assertion long before it could exhaust the machine (a naive build, the full
fp32 model on every rank, is stopped within its first gigabytes).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from launcher.config.layout_keys import from_config
from launcher.config.schema import compose_config
from launcher.errors import LauncherError, OutOfMemory
from launcher.layout import build_mesh
from launcher.model import Transformer
from launcher.model.init import BLOCK, meta_model
from launcher.parallel import build_runner, shard_model
from launcher.planner import build_options, resolve
from launcher.train.loop import train
from tests.conftest import predicted_at, run_cli, run_for, tiny_args, tiny_config
from tests.dist import run

MIB = 2**20
SLACK = 32 * MIB  # RoPE tables, small temporaries
FACTORIES = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like"}
FACTORIES |= {"randn", "randn_like", "rand", "rand_like", "arange", "new_empty", "new_zeros", "new_full"}


class OverBudget(Exception):
    pass


class AllocationBudget(TorchDispatchMode):
    """Live bytes of storages created on a real device (not meta); `OverBudget` as soon as an
    allocation would take them past `budget`. `peak`: the most that were alive at once."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget, self.peak = budget, 0
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}

    def _alive(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in FACTORIES and str(kwargs.get("device", "cpu")) != "meta":
            planned = func(*args, **{**kwargs, "device": torch.device("meta")})  # its size, nothing allocated
            if self._alive() + planned.untyped_storage().nbytes() > self.budget:
                raise OverBudget(f"{func} of {planned.untyped_storage().nbytes()} bytes with {self._alive()} alive")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                local = t._local_tensor if isinstance(t, DTensor) else t
                if local.device.type != "meta" and local.untyped_storage().data_ptr() not in self.live:
                    storage = local.untyped_storage()
                    self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self._alive())
        return out


def param_bytes(parts: list[torch.nn.Module]) -> tuple[int, int]:
    """(bytes of this rank's shards, bytes of the largest whole parameter in fp32) of meta parts."""
    params = {id(p): p for part in parts for p in part.parameters()}.values()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return sum(t.numel() * t.element_size() for t in local), max(p.numel() * 4 for p in params)


def build_within_budget(rank: int, world: int, overrides: list[str]) -> dict[str, int]:
    """Cut the model on meta to learn this rank's shard bytes, then build it for real under the budget."""
    cfg = compose_config(*overrides)
    layout = from_config(cfg, world)
    mesh = build_mesh(layout, "cpu")
    shards, largest = param_bytes(shard_model(meta_model(cfg.model), layout, build_options(cfg, layout), mesh)[0])
    budget = AllocationBudget(shards + largest + SLACK)
    try:
        with budget:
            runner = build_runner(cfg.model, layout, mesh, build_options(cfg, layout), torch.device("cpu"))
    except OverBudget as err:
        return {"over_budget": str(err), "shards": shards, "largest": largest}
    held = param_bytes(runner.parts)[0]
    return {"peak": budget.peak, "held": held, "shards": shards, "largest": largest}


@pytest.mark.slow
@pytest.mark.parametrize("model", [["+model=1b"], ["+model=8b", "model.n_layers=2"]], ids=["1b", "8b-width-2-layers"])
def test_no_rank_allocates_more_than_its_shards_and_one_parameter(model: list[str]) -> None:
    for rank, r in enumerate(run(build_within_budget, 4, [*model, "tp=4"], timeout=600)):
        budget = r["shards"] + r["largest"] + SLACK
        assert "over_budget" not in r, f"rank {rank} went past shards + one parameter ({budget} bytes): {r}"
        assert r["held"] == r["shards"] and r["peak"] >= r["shards"], f"rank {rank}: the counter saw {r}"
        # blockwise init: one block of BLOCK fp32 values beside the shards, not even a whole parameter
        assert r["peak"] <= r["shards"] + 4 * BLOCK + SLACK, f"rank {rank}: {r}"


def test_the_budget_stops_a_full_model_build_before_it_allocates() -> None:
    """A naive build on every rank (the whole model, fp32, on the device) is caught early."""
    cfg = compose_config("+model=8b", "model.n_layers=2").model
    budget = AllocationBudget(256 * MIB)
    with pytest.raises(OverBudget), budget:
        Transformer(cfg)
    assert budget.peak <= 256 * MIB


def test_steps_0_builds_reports_memory_and_stops(tmp_path: Any) -> None:
    cfg = tiny_config(tmp_path, "steps=0", "smoke=true", "hardware.peak_tflops=1.0")
    summary = train(run_for(cfg, prediction=predicted_at(cfg, 1.5)), tmp_path / "r")
    assert summary["steps"] == 0 and summary["smoke_loss"] > 0
    assert summary["peak_mem_gib_per_rank"] == [summary["peak_mem_gib"]] and summary["peak_mem_gib"] > 0
    assert summary["cpu_allocator"] == "lean", "a memory check measures the run, not glibc's cache"
    assert summary["peak_mem_measure"] == "process peak resident set less mapped files"
    assert not (tmp_path / "r" / "metrics.jsonl").exists() or not (tmp_path / "r" / "metrics.jsonl").read_text()
    assert not (tmp_path / "r" / "checkpoints").exists(), "nothing trained, nothing saved"


def test_out_of_memory_while_building_is_one_line(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            "[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456 bytes."
        )

    monkeypatch.setattr("launcher.model.init.torch.randn", no_memory)
    with pytest.raises(OutOfMemory) as err:
        cfg = tiny_config(tmp_path, "steps=0", "hardware.peak_tflops=1.0")
        train(run_for(cfg, prediction=predicted_at(cfg, 1.5)), tmp_path / "r")
    line = str(err.value)
    assert "\n" not in line and err.value.exit_code == 1
    assert "rank 0" in line and "123456 bytes" in line and "planner estimated 1.50 GiB" in line


def test_steps_0_on_a_layout_that_does_not_fit_is_refused_unless_forced(tmp_path: Any) -> None:
    args = ("+model=1b", "steps=0", "hardware.memory_gib=1")
    with pytest.raises(LauncherError, match="force=true"):
        resolve(compose_config(*args), 1)
    layout, prediction, _ = resolve(compose_config(*args, "force=true"), 1)
    assert not prediction.fits


@pytest.mark.slow
def test_train_steps_0_prints_each_ranks_memory_beside_the_prediction(tmp_path: Any) -> None:
    args = [a for a in tiny_args(tmp_path / "cache", steps=0) if not a.startswith("metrics.console")]
    result = run_cli("train", *args, "tp=2", "smoke=true", "metrics.console=plain", f"run_dir={tmp_path / 'r'}")
    assert result.returncode == 0, result.stderr[-2000:]
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: peak memory [\d.]+ GiB measured · predicted [\d.]+ GiB", result.stdout)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert len(summary["peak_mem_gib_per_rank"]) == 2 and summary["smoke_loss"] > 0
    assert "GiB (weights and one step's activations)" in result.stdout  # what the prediction covers
    assert 0 < summary["predicted_build_gib"] < summary["prediction"]["memory_gib"]


def test_steps_0_is_compared_with_what_a_build_holds_not_a_training_step() -> None:
    """A training step's peak (optimizer moments, activations) beside a mere build read as a 5x planner error."""
    from launcher.train.fit import predicted_build_gib

    _, prediction, _ = resolve(compose_config("+model=1b", "steps=0", "force=true"), 1)
    parts = prediction.memory.as_gib()
    built = predicted_build_gib(prediction, smoke=False)
    assert built == pytest.approx(parts["params"] + parts["buffers"] + parts["overhead"], abs=2e-3)
    smoked = predicted_build_gib(prediction, smoke=True)
    assert built < smoked < parts["total"]  # no optimizer moments in either
    assert parts["total"] - smoked == pytest.approx(parts["optimizer"] + parts["held"], abs=2e-3)
