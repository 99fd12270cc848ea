"""Every recipe is a promise: it composes, the planner accepts it and predicts what its header says,
and its dry run builds the sharded model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher.config.schema import CONF_DIR, compose_config
from launcher.config.validate import validate
from launcher.planner import resolve
from tests.conftest import run_cli

RECIPES = sorted(p.stem for p in (Path(CONF_DIR) / "recipe").glob("*.yaml"))
GPU_RECIPES = [r for r in RECIPES if compose_config(f"+recipe={r}").hardware.kind != "cpu"]


def test_the_promised_recipes_exist() -> None:
    assert {
        "llama3_8b_h100x8",
        "llama3_70b_h100x64",
        "llama3_405b_h100x2048",
        "llama3_405b_gb200nvl72",
        "megatron_gpt2_8.3b_v100x512",
        "cpu_tp_demo",
        "norm_position_study",
        "sweep_layouts_cpu",
        "moe_balance_study",
        "mixtral_8x7b_h100x16",
        "qwen3_235b_h100x64",
    } <= set(RECIPES)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_is_accepted_and_header_states_the_prediction(name: str) -> None:
    cfg = compose_config(f"+recipe={name}")
    _, prediction, _ = resolve(cfg)  # raises if refused, or predicted not to fit
    header = (Path(CONF_DIR) / "recipe" / f"{name}.yaml").read_text()
    stated = float(re.search(r"Planner prediction: MFU ([\d.]+)%", header).group(1))
    assert stated == pytest.approx(100 * prediction.mfu, abs=0.1), "re-run the planner and update the header"


@pytest.mark.parametrize("name", ["cpu_tp_demo", "sweep_layouts_cpu", "norm_position_study", "moe_balance_study"])
def test_cpu_recipes_compose_and_validate(name: str) -> None:
    cfg = compose_config(f"+recipe={name}")
    validate(cfg)
    assert cfg.hardware.kind == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_8b_h100x8", "llama3_405b_gb200nvl72", "megatron_gpt2_8.3b_v100x512"])
def test_recipe_dry_run_builds(name: str, tmp_path: Path) -> None:
    result = run_cli("train", f"+recipe={name}", "dry_run=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "GiB" in result.stdout
