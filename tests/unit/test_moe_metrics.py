"""Per-layer MoE load: the table every stage fills at its layers' global index (summed over stages in
balance_step's one tensor), the rich table `metrics.moe_table=true` shows, and the wandb histograms
(a fake wandb module: no network, no wandb files)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console

from launcher.config.schema import WandbConfig, compose_config
from launcher.errors import LauncherError
from launcher.metrics.console import ConsoleView
from launcher.metrics.moe_load import LayerLoad, layer_loads, load_histograms, load_table
from launcher.metrics.sinks import WandbSink
from launcher.model import moe_table
from launcher.model.init import initialized_model
from launcher.model.moe import balance_step, moe_layers
from launcher.model.moe_table import layer_records, layer_rows
from launcher.planner import resolve
from launcher.train.loop import train
from tests.conftest import run_for, tiny_config


def fake_layer(index: int, bias: float, capacity: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(layer=index, expert_bias=torch.full((4,), bias), capacity_factor=capacity)


def test_stages_tables_sum_to_every_layer_in_order() -> None:
    """Two pipeline stages, MoE layers 1 (stage 0) and 3 (stage 1) of 4: each stage's table holds its
    own layer; their sum reads back as both layers' loads, dense layers 0 and 2 left out."""
    first = layer_rows([fake_layer(1, 0.5)], torch.tensor([[6.0, 2, 0, 0]]), torch.tensor([0.0]), (4, 4))
    second = layer_rows([fake_layer(3, -0.25, 1.0)], torch.tensor([[3.0, 3, 3, 1]]), torch.tensor([2.0]), (4, 4))
    assert first[[0, 2, 3]].abs().sum() == 0 and first.shape == (4, 4 + moe_table.EXTRA)
    records = layer_records(first + second)  # plain numbers: the model packs nothing of the metrics'
    assert all(type(v) in (int, float, list, type(None)) for r in records for v in r.values())
    loads = layer_loads(records)
    assert loads == [LayerLoad(1, [6.0, 2, 0, 0], None, 0.5), LayerLoad(3, [3.0, 3, 3, 1], 2.0, 0.25)]
    assert loads[0].imbalance == 3.0 and loads[1].imbalance == 1.2
    assert loads[0].dropped_share is None and loads[1].dropped_share == pytest.approx(2 / 12)


def moe_model(**moe: Any) -> torch.nn.Module:
    m = compose_config("+model=moe_tiny").model
    cfg = dataclasses.replace(m, n_layers=3, moe=dataclasses.replace(m.moe, first_dense_layers=1, **moe))
    return initialized_model(cfg, 3, torch.device("cpu"))


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_balance_step_rows_agree_with_its_averages(capacity: float | None) -> None:
    """moe_tiny with a dense first layer: one load per MoE layer (1 and 2), every pick counted once,
    and the layer averages are the figures metrics.jsonl has."""
    model = moe_model(capacity_factor=capacity)
    tokens = 2 * 16
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    layers = moe_layers([model])
    metrics = balance_step(layers, lambda t: t, lambda t: t, table=(3, 8))
    loads = layer_loads(metrics["moe_layers"])
    assert [load.layer for load in loads] == [1, 2]
    for load in loads:
        picks = sum(load.tokens) + (load.dropped or 0)
        assert picks == tokens * 2  # top-2
        moved = sum(t != sum(load.tokens) / 8 for t in load.tokens)  # one step of gamma: all but experts at the mean
        assert load.bias_abs_mean == pytest.approx(0.001 * moved / 8)
    assert sum(load.imbalance for load in loads) / 2 == pytest.approx(metrics["moe_load_imbalance"])
    if capacity is None:
        assert all(load.dropped is None for load in loads) and metrics["moe_dropped_share"] == 0
    else:
        dropped = sum(load.dropped for load in loads)
        assert dropped > 0 and metrics["moe_dropped_share"] == pytest.approx(dropped / (2 * tokens * 2))
        assert max(max(load.tokens) for load in loads) == math.ceil(0.5 * tokens * 2 / 8)  # the capacity
    assert "moe_layers" not in balance_step(layers, lambda t: t, lambda t: t)  # only when asked


def record(load: LayerLoad) -> dict[str, Any]:
    """A load as the step hands it to the console and the sinks: plain numbers (model/moe_table.py)."""
    return dataclasses.asdict(load)


def rendered(table: Any) -> str:
    console = Console(record=True, width=120)
    console.print(table)
    return console.export_text()


def test_table_has_one_row_per_layer_and_dropped_only_with_a_capacity() -> None:
    loads = [LayerLoad(1, [30.0, 10, 20, 20], None, 0.002), LayerLoad(3, [5.0, 25, 20, 30], None, 0.004)]
    text = rendered(load_table(loads))
    lines = [line for line in text.splitlines() if line.strip("│ ").split(" ")[0] in ("1", "3")]
    assert len(lines) == 2
    assert [c.strip() for c in lines[0].strip("│").split("│")] == ["1", "1.50", "10", "30", "2.00e-03"]
    assert [c.strip() for c in lines[1].strip("│").split("│")] == ["3", "1.50", "5", "30", "4.00e-03"]
    assert "dropped" not in text
    capped = rendered(load_table([dataclasses.replace(loads[0], dropped=20.0)]))
    assert "dropped" in capped and "20.0%" in capped  # 20 of 100 picks


@pytest.mark.parametrize("asked", [True, False])
def test_rich_panel_shows_the_table_only_when_asked(asked: bool) -> None:
    view = ConsoleView("rich", 4, "header", moe_table=asked)
    view.update({"step": 1, "loss": 2.0}, [record(LayerLoad(0, [1.0, 3.0], None, 0.0))])
    titles = [getattr(part, "title", None) for part in view._view().renderables]
    view.close({})
    assert (load_table([]).title in titles) == asked


class FakeWandb:
    """The part of wandb the sink uses; records what a run logs."""

    class errors:  # noqa: N801 (wandb's name)
        Error = RuntimeError

    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int]] = []

    def Settings(self, **kw: Any) -> dict[str, Any]:  # noqa: N802
        return kw

    def Histogram(self, sequence: Any = None, np_histogram: Any = None, num_bins: int = 64) -> tuple:  # noqa: N802
        return ("histogram", sequence, np_histogram, num_bins)

    def init(self, **kw: Any) -> SimpleNamespace:
        return SimpleNamespace(log=lambda data, step: self.logged.append((data, step)), finish=lambda: None)


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_wandb_sink_logs_a_bar_per_expert_per_layer(fake_wandb: FakeWandb, tmp_path: Path) -> None:
    sink = WandbSink(WandbConfig(), tmp_path, {})
    sink.log({"step": 7, "loss": 1.5}, [record(LayerLoad(2, [4.0, 0, 1], None, 0.0))])
    data, step = fake_wandb.logged[0]
    assert step == 7 and data["loss"] == 1.5
    assert data["moe_tokens_per_expert/layer_2"] == ("histogram", None, ([4.0, 0, 1], [0, 1, 2, 3]), 64)
    many = LayerLoad(0, [1.0] * 600, None, 0.0)  # more experts than wandb's 512 bins: their distribution
    assert load_histograms([many], fake_wandb)["moe_tokens_per_expert/layer_0"][1:] == (many.tokens, None, 512)


def test_train_shows_the_table_and_logs_histograms_at_log_steps(
    fake_wandb: FakeWandb, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = ["model=moe_tiny", "steps=4", "checkpoint.every=0", "metrics.log_every=2", "metrics.console=plain"]
    cfg = tiny_config(tmp_path, *overrides, "metrics.moe_table=true", "metrics.wandb.mode=offline")
    train(run_for(cfg), tmp_path / "run")
    out = capsys.readouterr().out
    assert out.count("MoE load per layer") == 2  # plain: under the line of each logged step, 2 and 4
    assert [step for _, step in fake_wandb.logged] == [2, 4]
    charts = {"moe_tokens_per_expert/layer_0", "moe_tokens_per_expert/layer_1"}
    assert all(charts <= data.keys() for data, _ in fake_wandb.logged)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("moe_layers" not in row and "moe_load_imbalance" in row for row in rows)


def test_moe_table_on_a_dense_model_is_refused() -> None:
    with pytest.raises(LauncherError, match=r"metrics.moe_table=true shows the layers of a mixture of experts"):
        resolve(compose_config("+model=tiny", "metrics.moe_table=true"))
