"""`ft`'s services and groups (docs/fault-tolerance.md): torchft's Lighthouse and `ft.replicas` replica groups.

Each group is an ordinary run of 1 / replicas of the layout's `dp_replicate` ranks. On this machine each is
its own elastic agent (launcher/spawn.py), even for one rank, so that a failure restarts that group only
(`max_restarts` times), and it heals from a peer. Group 0's agent runs here and owns the run's outputs
(run_dir); group g's runs in a process of its own and writes under run_dir/replica_g (and
checkpoint.dir/replica_g). Under SLURM the emitted script (launcher/slurm.py) runs `serve` in its batch
step and each group as a job step of its own. The groups find the Lighthouse through TORCHFT_LIGHTHOUSE,
which torchft's Manager reads, and each other before their first step through LAUNCHER_FT_START
(launcher/train/replicas.py)."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.errors import WorkerFailed
from launcher.ft_config import FtConfig
from launcher.run import Run

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
START_ENV = "LAUNCHER_FT_START"  # host:port of the store where the groups meet before their first step
Launch = Callable[[Run, Path], dict[str, Any]]


def group_run(run: Run, replica: int) -> Run:
    """Replica group `replica`'s run: its share of the replicated dimension, its index, its checkpoints."""
    layout = replace(run.layout, dp_replicate=run.layout.dp_replicate // run.ft.replicas)
    checkpoint = run.checkpoint
    if replica and checkpoint.dir:  # else under its run_dir (group_dir)
        checkpoint = replace(checkpoint, dir=str(group_dir(Path(checkpoint.dir), replica)))
    return replace(run, layout=layout, replica=replica, checkpoint=checkpoint)


def group_dir(run_dir: Path, replica: int) -> Path:
    return run_dir if replica == 0 else run_dir / f"replica_{replica}"


@contextmanager
def services(ft: FtConfig, host: str = "127.0.0.1") -> Iterator[dict[str, str]]:
    """torchft's Lighthouse and the groups' meeting store, served while in the block; yields the
    environment that points a group's processes at them (reachable at `host`)."""
    # torchft's Rust side logs each quorum and commit at INFO; read when torchft is imported (here, and
    # in each group's processes: the environment yielded)
    os.environ.setdefault("RUST_LOG", "warn")
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    # a group that heartbeats but does not join is left out before the others' quorum times out
    join_ms, heartbeat_ms = int(ft.quorum_timeout_s * 500), int(ft.heartbeat_timeout_s * 1000)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=ft.min_replicas, join_timeout_ms=join_ms, heartbeat_timeout_ms=heartbeat_ms
    )
    start = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)  # served while it lives
    port = lighthouse.address().rsplit(":", 1)[1]
    try:
        rust_log = os.environ["RUST_LOG"]
        yield {LIGHTHOUSE_ENV: f"http://{host}:{port}", START_ENV: f"{host}:{start.port}", "RUST_LOG": rust_log}
    finally:
        lighthouse.shutdown()


def launch_replicas(run: Run, run_dir: Path, launch: Launch) -> dict[str, Any]:
    """Start the Lighthouse and the groups, each an ordinary `launch` of its layout (passed in, so this
    module does not import the launcher that calls it); return group 0's summary once every group has ended."""
    spawn = multiprocessing.get_context("spawn")
    others = [
        spawn.Process(target=launch, args=(group_run(run, g), group_dir(run_dir, g)), name=f"replica_{g}")
        for g in range(1, run.ft.replicas)
    ]
    with services(run.ft) as env:
        os.environ.update(env)  # inherited by every group's processes
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
            for name in (LIGHTHOUSE_ENV, START_ENV):
                os.environ.pop(name, None)
    failed = [(p.name, p.exitcode) for p in others if p.exitcode != 0]
    if failed:
        raise WorkerFailed(f"replica group {failed[0][0]} failed (exit {failed[0][1]}): see its log under {run_dir}")
    return summary | {"replicas": run.ft.replicas}


def serve(argv: list[str] | None = None) -> None:
    """`python -m launcher.ft_launch ENV_FILE --min_replicas ...`: the SLURM script's batch step serves
    the Lighthouse and the meeting store until it is signalled, having written the groups' environment
    to ENV_FILE (a shell file the script sources; written last, whole, so that its presence means ready)."""
    from launcher.slurm_job import rendezvous

    parser = argparse.ArgumentParser(prog="python -m launcher.ft_launch")
    parser.add_argument("env_file", type=Path)
    parser.add_argument("--min_replicas", type=int, required=True)
    for key in ("quorum_timeout_s", "heartbeat_timeout_s"):
        parser.add_argument(f"--{key}", type=float, required=True)
    args = parser.parse_args(argv)
    ft = FtConfig(**{k: v for k, v in vars(args).items() if k != "env_file"})
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # for sigwait (and the Lighthouse's threads) to leave them
    with services(ft, host=rendezvous()[0]) as env:
        partial = args.env_file.with_suffix(".partial")
        partial.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        partial.replace(args.env_file)
        signal.sigwait(stop)


if __name__ == "__main__":
    serve()
