"""`ft`'s services and groups (docs/fault-tolerance.md): torchft's Lighthouse and `ft.replicas` replica groups.

Each group is an ordinary run of 1 / replicas of the layout's `dp_replicate` ranks. On this machine each is
its own elastic agent (launcher/launch/spawn.py), even for one rank, so that a failure restarts that group only
(`max_restarts` times), and it heals from a peer. Group 0's agent runs here and owns the run's outputs
(run_dir); group g's runs in a process of its own and writes under run_dir/replica_g (and
checkpoint.dir/replica_g). Under SLURM the emitted script (launcher/launch/slurm.py) runs `serve` in its batch
step and each group as a job step of its own. The groups find the Lighthouse through TORCHFT_LIGHTHOUSE,
which torchft's Manager reads, and each other before their first step through LAUNCHER_FT_START
(launcher/train/replicas.py)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.config.ft import START_ENV, FtConfig
from launcher.config.run import Run
from launcher.errors import WorkerFailed

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
CONSOLE_LOG = "console.log"  # group g > 0's console output, in its run_dir (group 0's is the terminal)
LOSSES = (("final_loss", "loss"), ("val_loss", "val loss"))
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
    module does not import the launcher that calls it); return group 0's summary once every group has ended.
    The terminal reads as one run: a line on the groups, group 0's output (its step lines and summary), the
    other groups' errors whole lines prefixed `[gN]` (their console output goes to their `console.log`),
    and a closing line per group."""
    spawn = multiprocessing.get_context("spawn")
    others = [Group(spawn, launch, run, run_dir, g) for g in range(1, run.ft.replicas)]
    with services(run.ft) as env:
        os.environ.update(env)  # inherited by every group's processes
        print(opening_line(run, env[LIGHTHOUSE_ENV], run_dir), flush=True)
        try:
            for group in others:
                group.start()
            summary = launch(group_run(run, 0), run_dir)
            for group in others:
                group.join(run.ft.quorum_timeout_s)
        finally:
            for group in others:
                group.stop()
            for name in (LIGHTHOUSE_ENV, START_ENV):
                os.environ.pop(name, None)
    failed = [(g.process.name, g.process.exitcode) for g in others if g.process.exitcode != 0]
    if failed:
        raise WorkerFailed(f"replica group {failed[0][0]} failed (exit {failed[0][1]}): see its log under {run_dir}")
    if "preempted_at_step" not in summary:  # preempted: `train` says so, and where it saved
        print("\n".join(closing_lines(summary, others)), flush=True)
    return summary | {"replicas": run.ft.replicas}


def opening_line(run: Run, lighthouse: str, run_dir: Path) -> str:
    """`ft: 2 replica groups x world 1, quorum 2, lighthouse 127.0.0.1:PORT; group 0 prints here, ...`."""
    ft, world = run.ft, run.layout.world_size // run.ft.replicas
    others = "group 1 to" if ft.replicas == 2 else f"groups 1 to {ft.replicas - 1} each to its"
    where = group_dir(run_dir, 1) if ft.replicas == 2 else run_dir / "replica_N"
    return (
        f"ft: {ft.replicas} replica groups x world {world}, quorum {ft.min_replicas}, "
        f"lighthouse {lighthouse.removeprefix('http://')}; group 0 prints here, {others} {where / CONSOLE_LOG}"
    )


def closing_lines(summary: dict[str, Any], others: list[Group]) -> list[str]:
    """A line per other group (how it ended), then whose figures the summary above is and, where the
    groups' validation losses differ (each validates its own share of the batches), all of them."""
    ended = {0: summary} | {g.replica: g.summary() for g in others}
    lines = [f"[g{g.replica}] {ended_text(ended[g.replica], g.run_dir)}" for g in others]
    val = {g: s["val_loss"] for g, s in ended.items() if s.get("val_loss") is not None}
    text = f"ft: the summary above is group 0's, of {len(ended)} groups"
    if len(set(val.values())) > 1:
        each = " · ".join(f"g{g} {v:.4f}" for g, v in val.items())
        text += f"; val loss {sum(val.values()) / len(val):.4f} over the groups ({each})"
    return [*lines, text]


def ended_text(summary: dict[str, Any], run_dir: Path) -> str:
    if not summary:
        return f"ended without a summary: see {run_dir / CONSOLE_LOG}"
    figures = [f"{summary.get('steps', 0)} steps"]
    figures += [f"{label} {summary[key]:.4f}" for key, label in LOSSES if summary.get(key) is not None]
    return f"ended: {', '.join(figures)} ({run_dir}: summary.json, {CONSOLE_LOG})"


class Group:
    """Replica group g > 0 on this machine: its agent's process (`launch` in a fresh interpreter), whose
    console output goes to its run_dir's CONSOLE_LOG and whose stderr comes back through a pipe, relayed
    here whole line by line, prefixed `[gN]`, to this process's stderr and the log."""

    def __init__(self, spawn: Any, launch: Launch, run: Run, run_dir: Path, replica: int) -> None:
        self.replica, self.run_dir = replica, group_dir(run_dir, replica)
        self.err, err_w = spawn.Pipe(duplex=False)
        metrics = replace(run.metrics, console="plain") if run.metrics.console != "none" else run.metrics
        group = replace(group_run(run, replica), metrics=metrics)  # a file: no live panel
        self.process = spawn.Process(
            target=redirected, args=(launch, group, self.run_dir, err_w), name=f"replica_{replica}"
        )
        self.writer, self.relay = err_w, threading.Thread(target=self.relay_lines, daemon=True)

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.process.start()
        self.writer.close()  # the group's processes hold the pipe's write end now: EOF once they all end
        self.relay.start()

    def relay_lines(self) -> None:
        prefix = f"[g{self.replica}] ".encode()
        with open(self.err.fileno(), "rb", closefd=False) as lines, (self.run_dir / CONSOLE_LOG).open("ab") as log:
            for line in lines:
                os.write(2, prefix + line)  # one write: never mixed into another process's line
                log.write(line)
                log.flush()

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout=timeout_s)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.writer.close()  # not started: else closed already
        if self.relay.ident is None:
            return
        self.relay.join(timeout=5.0)  # its last lines; a child of the group that outlives it must not hang this
        if not self.relay.is_alive():  # else its fd stays open under it (a daemon thread: ends with the process)
            self.err.close()

    def summary(self) -> dict[str, Any]:
        path = self.run_dir / "summary.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}


def redirected(launch: Launch, run: Run, run_dir: Path, err: Any) -> dict[str, Any]:
    """A group's process: its stdout (and its workers') appended to CONSOLE_LOG, its stderr into the pipe
    its Group relays, before anything starts; then the group's `launch`."""
    with (run_dir / CONSOLE_LOG).open("ab") as log:
        os.dup2(log.fileno(), 1)
    os.dup2(err.fileno(), 2)
    err.close()
    return launch(run, run_dir)


def serve(argv: list[str] | None = None) -> None:
    """`python -m launcher.launch.ft ENV_FILE --min_replicas ...`: the SLURM script's batch step serves
    the Lighthouse and the meeting store until it is signalled, having written the groups' environment
    to ENV_FILE (a shell file the script sources; written last, whole, so that its presence means ready)."""
    from launcher.launch.slurm_job import rendezvous

    parser = argparse.ArgumentParser(prog="python -m launcher.launch.ft")
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
