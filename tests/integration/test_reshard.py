"""Checkpoints across layouts and failures (local gloo workers): a checkpoint written under one
layout resumes under another with the same losses, and a killed worker restarts the group, which
resumes from the newest complete checkpoint and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.launch.spawn import start_local_workers
from launcher.train.loop import train
from tests.conftest import losses, run_for, tiny_config, worker_pids

pytestmark = pytest.mark.slow

COMMON = ("hardware.peak_tflops=1.0", "steps=6", "batch.global=8", "threads=1")


def run(tmp_path: Path, name: str, *overrides: str) -> Path:
    cfg = tiny_config(tmp_path, *COMMON, *overrides)
    job, run_dir = run_for(cfg, None), tmp_path / name
    if job.layout.world_size == 1:
        train(job, run_dir)
    else:
        start_local_workers(job, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("reference")
    return losses(run(tmp, "single", "checkpoint.every=0"))


@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [
        (("tp=2", "checkpoint.async_save=true"), ("dp=2", "dp_shard=2")),  # tensor parallel (async save) -> FSDP
        (("pp=2", "pp_schedule=1f1b"), ()),  # pipeline -> one process
        (("dp=2", "dp_shard=2"), ("dp=2", "dp_shard=1", "dp_replicate=2")),  # FSDP -> DDP
        (("cp=2",), ()),  # context parallel (FSDP over the cp ranks) -> one process
        ((), ("cp=2",)),  # and back
    ],
    ids=["tp2-to-fsdp2", "pp2-to-single", "fsdp2-to-ddp2", "cp2-to-single", "single-to-cp2"],
)
def test_checkpoint_reshards_across_layouts(
    tmp_path: Path, reference: dict[int, float], saved_under: tuple[str, ...], resumed_under: tuple[str, ...]
) -> None:
    saved = run(tmp_path, "saved", "checkpoint.every=3", *saved_under)
    checkpoint = saved / "checkpoints" / "step_00000003"
    resumed = run(tmp_path, "resumed", f"resume={checkpoint}", "checkpoint.every=0", *resumed_under)
    got = losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([reference[s] for s in (4, 5, 6)], rel=1e-4)


@pytest.mark.parametrize(
    ("saved_under", "resumed_under"), [(("pp=2", "pp_schedule=1f1b"), ()), ((), ("pp=2", "pp_schedule=1f1b"))]
)
def test_tied_embeddings_reshard_between_pipeline_and_one_process(
    tmp_path: Path, saved_under: tuple[str, ...], resumed_under: tuple[str, ...]
) -> None:
    """The last stage's copy of a tied embedding is saved and loaded under the one-process names
    (launcher/train/model_view.py): its values and optimizer state come back either way."""
    tied = "model.tied_embeddings=true"
    reference = losses(run(tmp_path, "single", "checkpoint.every=0", tied))
    saved = run(tmp_path, "saved", "checkpoint.every=3", tied, *saved_under)
    checkpoint = saved / "checkpoints" / "step_00000003"
    got = losses(run(tmp_path, "resumed", f"resume={checkpoint}", "checkpoint.every=0", tied, *resumed_under))
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([reference[s] for s in (4, 5, 6)], rel=1e-4)


def test_sigkilled_worker_restarts_and_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    steps, every = 10, 2
    args = [
        "+model=tiny",
        "seq_len=32",
        "batch.micro=4",
        "tp=2",
        f"steps={steps}",
        f"checkpoint.every={every}",
        "max_restarts=1",
        "threads=1",
        "metrics.console=plain",
        "metrics.wandb.mode=disabled",
        "eval.every=0",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_bytes=200000",
        "hardware.peak_tflops=1.0",
    ]
    exe = str(Path(sys.executable).parent / "train")
    env = {**os.environ, "LAUNCHER_OUTPUTS": str(tmp_path)}
    subprocess.run([exe, *args, f"run_dir={tmp_path / 'whole'}"], check=True, capture_output=True, env=env)
    proc = subprocess.Popen(
        [exe, *args, f"run_dir={tmp_path / 'killed'}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    jsonl, deadline = tmp_path / "killed" / "metrics.jsonl", time.time() + 120
    while not (jsonl.exists() and jsonl.read_text().count("\n") >= 5) and time.time() < deadline:
        time.sleep(0.02)
    killed_after = jsonl.read_text().count("\n")
    victims = worker_pids(proc.pid)
    assert victims, "no local workers found"
    os.kill(victims[-1], signal.SIGKILL)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()[-3000:]
    whole, killed = losses(tmp_path / "whole"), losses(tmp_path / "killed")
    assert killed[steps] == pytest.approx(whole[steps], rel=1e-5)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    redone = len(rows) - steps  # steps trained twice: those after the last complete checkpoint
    assert killed_after < steps and 0 <= redone <= every + 1
    assert any("resumed from step" in line for line in out.decode().splitlines())
