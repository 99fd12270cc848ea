"""The watchdog: a rank that stops making progress ends the run in one line naming it, instead of
leaving every other rank waiting in a collective for the process group's timeout (gloo's default:
30 minutes) without a word.

Each rank reports where it is (`Watchdog.phase`: an attribute write, no syscall) and a daemon thread
writes it every `period` to `RUN_DIR/watchdog/rank_N.json` (atomically): the step, the phase, when the
phase began (`since`), when the beat was written (`time`) and how long the phase may last. Two clocks
tell two failures apart: a beat that goes stale means the whole process stopped (SIGSTOP, not
scheduled, a C call holding the GIL); a fresh beat with an old `since` means a live rank stuck in its
phase (in a collective waiting for a peer, or slow itself). Among live ranks the one furthest behind
(step, then phase order) is the one that stopped; the others are waiting for it.

A rank whose own phase outlasts its allowance dumps its Python stacks (every thread) to
`rank_N.stacks` and, on CUDA, NCCL's flight recorder; then, run here (torchrun, SLURM), it prints the
line and exits `HUNG`, so the scheduler's requeue applies. Local workers leave that to their launcher
(`LocalMonitor`, polled by spawn.supervise), which sees every rank's beats: it asks the stale ranks
for stacks (faulthandler on SIGUSR2; a stopped process cannot answer), kills the group, prints the
line, and the elastic agent restarts it from the last checkpoint (`max_restarts`) or the run exits `HUNG`.

Tests stop or stall a rank through `LAUNCHER_TEST_HANG=STEP:RANK[:stop|sleep]` (launcher/train/faults.py;
first attempt only, so a restarted group runs through): at STEP, as it would enter forward_backward, that
rank SIGSTOPs itself (its beat says forward_backward) or sleeps (its beat says data).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from launcher.errors import HUNG
from launcher.files import write_atomic
from launcher.train.faults import fault_plan
from launcher.train.preemption import LOCAL_WORKER_ENV
from launcher.train.timeouts import PHASES, SLOW_FACTOR, SLOW_PHASES, beat_period, stale_after, timeout_for

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from launcher.config.schema import WatchdogConfig

log = logging.getLogger("launcher")

STACKS_SIGNAL = signal.SIGUSR2  # SIGUSR1, SIGTERM, SIGINT mean "save and stop" (train/preemption.py)
DUMP_WAIT_S = 5.0  # how long the launcher waits for live ranks' stacks before it kills the group
BACKSTOP_S = 60.0  # a local worker whose launcher did not kill it after its own report exits by itself


def run_attempt() -> str:
    """The run and attempt this process belongs to: beats of another (an earlier run in the same
    run_dir, a group before a restart) are not its peers'."""
    env = os.environ
    run = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or ""
    return f"{run}/{env.get('TORCHELASTIC_RESTART_COUNT') or env.get('SLURM_RESTART_COUNT') or 0}"


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    host: str
    attempt: str
    step: int
    phase: str
    since: float  # wall time the phase began
    time: float  # wall time the beat was written: the process ran then
    allow_s: float  # how long this phase may last

    def progress(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)

    def overdue(self, now: float) -> bool:
        return self.phase != "done" and now - self.since > self.allow_s


def beat_path(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank}.json"


def stacks_path(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank}.stacks"


def read_beats(folder: Path, world: int) -> dict[int, Beat | None]:
    """Every rank's last beat (None: none yet, or unreadable)."""
    beats: dict[int, Beat | None] = {}
    for rank in range(world):
        try:
            beats[rank] = Beat(**json.loads(beat_path(folder, rank).read_text()))
        except (OSError, ValueError, TypeError):
            beats[rank] = None
    return beats


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def describe(beats: dict[int, Beat | None], now: float, stale_s: float) -> str:
    """Who stopped, and who waits for them: the ranks without a fresh beat; else the live ranks furthest
    behind (all of them when every rank is at the same place); the others wait, each where it is."""
    stopped = [r for r, b in beats.items() if b is None or now - b.time > stale_s]
    live = {r: b for r, b in beats.items() if r not in stopped and b is not None}
    lowest = min((b.progress() for b in live.values()), default=None)
    culprits = stopped or [r for r, b in live.items() if b.progress() == lowest]
    parts = []
    for rank in culprits:
        beat = beats[rank]
        if beat is None:
            parts.append(f"rank {rank} never reported")
        elif rank in stopped:
            parts.append(
                f"rank {rank} stopped responding (not scheduled / stopped: it cannot dump its stacks) in phase "
                f"{beat.phase} at step {beat.step}, silent for {now - beat.time:.0f} s"
            )
        else:
            parts.append(f"rank {rank} stuck in phase {beat.phase} at step {beat.step} for {now - beat.since:.0f} s")
    waiting: dict[tuple[str, int], list[int]] = {}
    for rank, beat in live.items():
        if rank not in culprits:
            waiting.setdefault((beat.phase, beat.step), []).append(rank)
    for (phase, step), ranks in waiting.items():
        parts.append(f"{ranks_text(ranks)} waiting in phase {phase} at step {step}")
    return "; ".join(parts)


def report_line(beats: dict[int, Beat | None], now: float, stale_s: float, folder: Path, cuda: bool) -> str:
    where = f"stacks: {folder}/rank_N.stacks"
    if cuda:
        where += f", NCCL flight recorder: {folder.parent / 'flight_recorder'}/rank_N"
    return f"watchdog: {describe(beats, now, stale_s)} ({where})"


def dump_flight_recorder(rank: int) -> None:
    """This process's NCCL flight recorder, where torch writes it on a timeout (rank_env.flight_recorder_env)."""
    from launcher.compat.torch_compat import flight_recorder_trace

    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if prefix:
        write_atomic(Path(f"{prefix}{rank}"), flight_recorder_trace())


class Watchdog:
    """One rank's beats, and its own check: started by spawn.watching, read by the training loop."""

    def __init__(self, folder: Path, rank: int, world: int, timeout_s: float, local: bool, cuda: bool) -> None:
        self.folder, self.rank, self.world, self.timeout_s = folder, rank, world, timeout_s
        self.local, self.cuda = local, cuda
        self.step, self.name, self.since, self.first_step = 0, "setup", time.time(), -1
        self.attempt, self.host = run_attempt(), socket.gethostname()
        self.hang = fault_plan().hang_of(rank) if self.attempt.endswith("/0") else None  # tests only
        self.done = threading.Event()
        folder.mkdir(parents=True, exist_ok=True)
        self.stacks: IO[str] = stacks_path(folder, rank).open("w")  # emptied: a dump here is this run's
        faulthandler.register(STACKS_SIGNAL, file=self.stacks, all_threads=True)
        self.beat()
        self.thread = threading.Thread(target=self.run, name="watchdog", daemon=True)
        self.thread.start()

    def phase(self, name: str, step: int) -> None:
        """Entering `name` at `step` (PHASES); cheap enough to call several times a step."""
        if self.hang and self.hang.step == step and name == "forward_backward":
            stall(self, self.hang.mode)
        if self.first_step < 0 and name != "setup":
            self.first_step = step
        self.step, self.name, self.since = step, name, time.time()

    def allowance(self) -> float:
        slow = self.name in SLOW_PHASES or self.step <= self.first_step
        return self.timeout_s * (SLOW_FACTOR if slow else 1.0)

    def beat(self) -> Beat:
        beat = Beat(
            self.rank, os.getpid(), self.host, self.attempt, self.step, self.name, self.since, time.time(),
            self.allowance(),
        )  # fmt: skip
        write_atomic(beat_path(self.folder, self.rank), json.dumps(asdict(beat)))
        return beat

    def run(self) -> None:
        while not self.done.wait(beat_period(self.timeout_s)):
            if self.beat().overdue(time.time()):
                self.trip()

    def trip(self) -> None:
        """This rank is stuck: its stacks and flight recorder, the line; then exit (or, a local worker,
        wait for the launcher, which reports for every rank and kills the group)."""
        faulthandler.dump_traceback(file=self.stacks, all_threads=True)
        self.stacks.flush()
        if self.cuda:
            dump_flight_recorder(self.rank)
        peers = read_beats(self.folder, self.world)
        beats = {r: b if b is not None and b.attempt == self.attempt else None for r, b in peers.items()}
        line = report_line(beats, time.time(), stale_after(self.timeout_s), self.folder, self.cuda)
        log.error("%s", line)
        for handler in log.handlers:
            handler.flush()
        if self.local and self.done.wait(BACKSTOP_S):
            return
        print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(HUNG)

    def close(self) -> None:
        """The run is over on this rank: a last beat that never trips (its peers may still be finishing)."""
        self.done.set()
        self.thread.join()
        self.name = "done"
        self.beat()
        faulthandler.unregister(STACKS_SIGNAL)
        self.stacks.close()


class Off:
    """The watchdog when `watchdog.timeout_s=0` (and in direct calls of the loop): phases go nowhere."""

    def phase(self, name: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def watching(
    cfg: WatchdogConfig, kind: str, run_dir: Path, rank: int, world: int, step_s: float
) -> Iterator[Watchdog | Off]:
    """This rank's watchdog for the life of its training (spawn.run_rank, and a world of one)."""
    timeout_s = timeout_for(cfg, kind, step_s)
    local = bool(os.environ.get(LOCAL_WORKER_ENV))
    watchdog = Watchdog(run_dir / "watchdog", rank, world, timeout_s, local, kind == "cuda") if timeout_s else Off()
    try:
        yield watchdog
    finally:
        watchdog.close()


def stall(watchdog: Watchdog, mode: str) -> None:
    if mode == "sleep":  # still in phase data: a slow rank the others wait for in their collective
        time.sleep(3600)
        return
    watchdog.name, watchdog.since = "forward_backward", time.time()
    watchdog.beat()
    os.kill(os.getpid(), signal.SIGSTOP)


class LocalMonitor:
    """The local launcher's view of its workers' beats (spawn.supervise polls `check`)."""

    def __init__(self, folder: Path, world: int, timeout_s: float, cuda: bool) -> None:
        self.folder, self.world, self.timeout_s, self.cuda = folder, world, timeout_s, cuda
        self.lines: list[str] = []  # one per hang found, the last one the run's error when it fails
        self.next_check = 0.0
        self.killed: set[int] = set()
        # the agent's traceback of each worker killed here: not news, the line says why (compat.quiet_agent_logs)
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(self.not_killed)

    def not_killed(self, record: logging.LogRecord) -> bool:
        return not any(f"(pid: {pid})" in record.getMessage() for pid in self.killed)

    def poll(self, agent: LocalElasticAgent) -> None:
        """Check the agent's group while it runs; a hang's line now when the agent restarts the group
        (otherwise it is the run's error: spawn.start_local_workers raises `Hung`)."""
        from torch.distributed.elastic.agent.server.api import WorkerState

        group = agent.get_worker_group()
        if group.state == WorkerState.HEALTHY:
            line = self.check({worker.global_rank: worker.id for worker in group.workers if worker.id})
            if line and len(self.lines) <= group.spec.max_restarts:
                print(f"{line}; restarting from the last checkpoint", file=sys.stderr, flush=True)

    def check(self, pids: dict[int, int]) -> str | None:
        """`pids`: each rank's worker process now (a healthy group). A rank overdue by one period more
        than its own check needs (so that a live one has dumped its stacks and flight recorder): the
        others' stacks asked for, the group killed, and the line returned."""
        now = time.time()
        if not self.timeout_s or now < self.next_check or len(pids) < self.world:
            return None
        self.next_check = now + 0.5
        beats = read_beats(self.folder, self.world)
        beats = {r: b if b is not None and b.pid == pids.get(r) else None for r, b in beats.items()}
        late = now - beat_period(self.timeout_s) - 1.0
        if not any(b is not None and b.overdue(late) for b in beats.values()):
            return None
        stale_s = stale_after(self.timeout_s)
        live = [r for r, b in beats.items() if b is not None and now - b.time <= stale_s]
        for rank, pid in pids.items():  # faulthandler answers at once; a stopped process only once continued
            if not stacks_written(self.folder, rank):
                signal_quietly(pid, STACKS_SIGNAL)
        deadline = now + DUMP_WAIT_S
        while time.time() < deadline and not all(stacks_written(self.folder, r) for r in live):
            time.sleep(0.05)
        for pid in pids.values():
            self.killed.add(pid)
            signal_quietly(pid, signal.SIGKILL)
        line = report_line(beats, now, stale_s, self.folder, self.cuda)
        self.lines.append(line)
        return line


def stacks_written(folder: Path, rank: int) -> bool:
    path = stacks_path(folder, rank)  # created (empty) when the rank's watchdog starts
    return path.exists() and path.stat().st_size > 0


def signal_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
