"""End-to-end training in one process: reproducibility, accumulation, outputs, launch path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launcher.config.extras import installed
from launcher.config.layout_keys import from_config
from launcher.launch.rank_env import RankEnv, env_rank
from launcher.train.loop import train
from tests.conftest import run_cli, run_for, tiny_config

JSONL_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "mem_gib"}
SUMMARY_KEYS = {"final_loss", "val_loss", "median_tokens_per_s", "median_mfu", "world_size", "layout", "wall_time_s"}


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_same_seed_same_losses_other_seed_other_losses(tmp_path: Path) -> None:
    runs = {}
    for name, seed in [("a", 7), ("b", 7), ("c", 8)]:
        train(run_for(tiny_config(tmp_path, f"seed={seed}")), tmp_path / name)
        runs[name] = losses(tmp_path / name)
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path: Path) -> None:
    accumulated = train(run_for(tiny_config(tmp_path, "batch.micro=2", "batch.global=8")), tmp_path / "acc")
    whole = train(run_for(tiny_config(tmp_path, "batch.micro=8")), tmp_path / "whole")
    assert accumulated["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-4)


def test_loss_falls(tmp_path: Path) -> None:
    summary = train(run_for(tiny_config(tmp_path, "steps=40", "optim.warmup_steps=5", "optim.lr=1e-2")), tmp_path / "r")
    curve = losses(tmp_path / "r")
    assert summary["final_loss"] < curve[0] - 1.0, curve


@pytest.mark.slow
def test_outputs_jsonl_summary_and_wandb_offline_without_api_key(tmp_path: Path, monkeypatch) -> None:
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, "metrics.wandb.mode=offline", "eval.every=2", "eval.batches=1")
    summary = train(run_for(cfg), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(JSONL_KEYS <= r.keys() for r in rows)
    assert "val_loss" in rows[1] and 0 < rows[0]["mfu"] < 1.5
    written = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= written.keys() and written["final_loss"] == summary["final_loss"]
    assert written["val_loss"] == rows[-1]["val_loss"]
    assert written["cpu_allocator"] == "fast", "training reuses freed blocks (no page faults per large tensor)"
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"API key written to {path}"


def test_rank_comes_from_torchrun_or_slurm_environment(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    assert env_rank() is None  # start local workers ourselves
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert env_rank() == RankEnv(3, 4, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert env_rank() == RankEnv(1, 2, 0)  # torchrun wins


def test_auto_dp_takes_the_remaining_ranks(tmp_path: Path) -> None:
    layout = from_config(tiny_config(tmp_path, "tp=2"), 8)
    assert (layout.tp, layout.dp, layout.dp_shard, layout.world_size) == (2, 4, 4, 8)


@pytest.mark.slow
def test_train_cli_end_to_end(tmp_path: Path) -> None:
    result = run_cli(
        "train",
        "+model=tiny",
        "steps=3",
        "seq_len=32",
        "batch.micro=2",
        "metrics.console=plain",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_bytes=100000",
        f"run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"WANDB_MODE": os.environ.get("WANDB_MODE", "offline")},
    )
    assert result.returncode == 0, result.stderr
    assert "step=3" in result.stdout and "summary" in result.stdout
    assert "│ tokens/s " in result.stdout and "median_tokens_per_s" not in result.stdout  # words, not keys
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "rank0.log").exists()
    if installed("matplotlib"):  # the loss curve, and the line that says where it went
        assert (tmp_path / "run" / "loss.png").read_bytes().startswith(b"\x89PNG")
        assert "loss curve: run/loss.png" in result.stdout  # relative to where train ran
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["prediction"]["tokens_per_step"] == 2 * 32  # handed to the loop, not read from a file
    assert not (tmp_path / "run" / "prediction.json").exists()
    # Hydra's record of the run (config, overrides, log) beside its files, and no stray dated folder
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists() and (tmp_path / "run" / "train.log").exists()
    assert not (tmp_path / "outputs").exists()


def _write_many(path: str) -> None:
    from launcher.files import write_json

    for i in range(300):
        write_json(Path(path), {"i": i})


def test_ranks_writing_the_same_json_at_once_do_not_collide(tmp_path: Path) -> None:
    """Several processes may write one JSON file at once: a shared temporary name made one's rename fail."""
    import multiprocessing as mp

    path = tmp_path / "prediction.json"
    procs = [mp.get_context("fork").Process(target=_write_many, args=(str(path),)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert json.loads(path.read_text())["i"] == 299 and not list(tmp_path.glob("*.tmp"))
