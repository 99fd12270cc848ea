"""`ft` on this machine (docs/fault-tolerance.md): torchft's Lighthouse and `ft.replicas` replica groups.

Each group is an ordinary run of 1 / replicas of the layout's `dp_replicate` ranks: a group of one rank
trains in its own process, a larger one is its own elastic agent (launcher/spawn.py), so that a failure
restarts that group only. Group 0 runs here and owns the run's outputs (run_dir); group g writes under
run_dir/replica_g. The groups find the Lighthouse through TORCHFT_LIGHTHOUSE, which torchft's Manager
reads (launcher/train/replicas.py)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.errors import WorkerFailed
from launcher.run import Run

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
Launch = Callable[[Run, Path], dict[str, Any]]


def group_run(run: Run, replica: int) -> Run:
    """Replica group `replica`'s run: its share of the replicated dimension, its index."""
    layout = replace(run.layout, dp_replicate=run.layout.dp_replicate // run.ft.replicas)
    return replace(run, layout=layout, replica=replica)


def group_dir(run_dir: Path, replica: int) -> Path:
    return run_dir if replica == 0 else run_dir / f"replica_{replica}"


def launch_replicas(run: Run, run_dir: Path, launch: Launch) -> dict[str, Any]:
    """Start the Lighthouse and the groups, each an ordinary `launch` of its layout (passed in, so this
    module does not import the launcher that calls it); return group 0's summary once every group has ended."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=run.ft.min_replicas)
    os.environ[LIGHTHOUSE_ENV] = lighthouse.address()  # inherited by every group's processes
    spawn = multiprocessing.get_context("spawn")
    others = [
        spawn.Process(target=launch, args=(group_run(run, g), group_dir(run_dir, g)), name=f"replica_{g}")
        for g in range(1, run.ft.replicas)
    ]
    try:
        for process in others:
            process.start()
        summary = launch(group_run(run, 0), run_dir)
        for process in others:
            process.join(timeout=run.ft.quorum_timeout_s)
    finally:
        for process in others:
            if process.is_alive():
                process.kill()
                process.join()
        lighthouse.shutdown()
        os.environ.pop(LIGHTHOUSE_ENV, None)
    failed = [(p.name, p.exitcode) for p in others if p.exitcode != 0]
    if failed:
        raise WorkerFailed(f"replica group {failed[0][0]} failed (exit {failed[0][1]}): see its log under {run_dir}")
    return summary | {"replicas": run.ft.replicas}
