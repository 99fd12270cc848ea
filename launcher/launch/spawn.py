"""Where the ranks run: here (inside torchrun or a SLURM task) or in local workers we start.

"Run here" is read from the environment that torchrun or SLURM sets. Otherwise a world of one runs
in this process (no launch cost), and a larger world starts one local worker per rank through
PyTorch's elastic agent, which also tears the group down when a worker dies (and restarts it). The
local launcher owns its workers' signals: SIGINT, SIGTERM and SIGUSR1 sent to it mean "every rank saves
at the same step and stops", as they do for a rank of torchrun or SLURM.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from multiprocessing import resource_tracker
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from launcher.compat.torch_compat import (
    bound_device,
    failure_line,
    leave_process_groups,
    quiet_agent_logs,
    stop_forkserver,
)
from launcher.config.layout_keys import rendezvous_variables
from launcher.config.run import Run
from launcher.errors import CROSSING, Hung, WorkerFailed
from launcher.launch.ft import launch_replicas
from launcher.launch.quick_exit import skip_final_collections
from launcher.launch.rank_env import RankEnv, env_rank, flight_recorder_env, local_device
from launcher.layout import owner_rank
from launcher.train.preemption import LOCAL_WORKER_ENV, STOP_SIGNALS, PreemptionFlag, local_worker_signals
from launcher.train.timeouts import collective_timeout_s, timeout_for
from launcher.train.watchdog import LocalMonitor, watching

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent


def join_group(run: Run, env: RankEnv, run_dir: Path) -> None:
    """Join the default process group: NCCL bound to this rank's GPU (set as the current device), its
    flight recorder writing under `run_dir`; gloo on CPUs."""
    import torch
    import torch.distributed as dist

    device = None
    if run.options.device == "cuda":
        device = torch.device("cuda", local_device(env.local_rank))
        torch.cuda.set_device(device)
        flight_recorder_env(run_dir)
    store = None
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # The agent's store outlives a restart: without a per-attempt prefix, a restarted group can
        # read the dead workers' addresses and wait on them forever.
        base, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size))
        store = dist.PrefixStore(f"launcher/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/", base)
    watchdog_s = timeout_for(run.watchdog, run.options.device, run.predicted_step_s)
    timeout = timedelta(seconds=collective_timeout_s(run.nccl_timeout_s, watchdog_s))
    backend = "nccl" if device is not None else "gloo"
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **bound_device(device)
    )


def run_rank(run: Run, run_dir: Path) -> dict[str, Any]:
    """Body of every rank when the world is larger than one: join the group, train, leave."""
    skip_final_collections()
    if os.environ.get(LOCAL_WORKER_ENV):
        local_worker_signals()
    env = env_rank()
    assert env is not None, "run_rank needs RANK/WORLD_SIZE (torchrun, elastic launch) or SLURM variables"
    rendezvous_variables(os.environ)  # MASTER_PORT given (torchrun's, SLURM's), MASTER_ADDR this host by default
    join_group(run, env, run_dir)
    try:
        return train_rank(run, run_dir, env.rank)
    finally:
        leave_process_groups()


def train_rank(run: Run, run_dir: Path, rank: int) -> dict[str, Any]:
    """Train this rank, its phases reported to its watchdog (launcher/train/watchdog.py)."""
    from launcher.train.loop import train

    world, step_s = run.layout.world_size, run.predicted_step_s
    with watching(run.watchdog, run.options.device, run_dir, rank, world, step_s) as watchdog:
        return train(run, run_dir, rank, watchdog)


# Workers are forked from multiprocessing's forkserver, started (by the agent's first worker) for this
# launch: it imports these once, so that N workers cost one import of torch and the launcher, not N
# (two steps at tp=2: 15.8 -> 10.5 s of CPU; at tp=2 dp=2: 28.8 -> 12.3 s). It inherits the agent
# thread's blocked stop signals, and its children with them (train/preemption.py).
WORKER_MODULES = ["launcher.launch.spawn", "launcher.train.loop"]


def start_local_workers(run: Run, run_dir: Path) -> dict[str, Any]:
    """One process per rank on this machine; returns the summary of the output-owning rank."""
    agent = local_agent(run, run_dir)
    timeout_s = timeout_for(run.watchdog, run.options.device, run.predicted_step_s)
    monitor = LocalMonitor(run_dir / "watchdog", run.layout.world_size, timeout_s, run.options.device == "cuda")
    os.environ[LOCAL_WORKER_ENV] = "1"  # inherited by the workers (see launcher/train/preemption.py)
    stop_forkserver()  # one of an earlier launch in this process would hand its environment to these workers
    multiprocessing.set_forkserver_preload(WORKER_MODULES)
    try:
        result = supervise(agent, monitor)
    finally:
        os.environ.pop(LOCAL_WORKER_ENV, None)
        agent.get_worker_group().spec.rdzv_handler.shutdown()
        stop_forkserver()
    if result.is_failed() and monitor.lines:  # the hang it found, not the kill that ended it
        raise Hung(monitor.lines[-1])
    if result.is_failed():
        rank, failure = first_cause(result.failures)
        line = failure_line(failure)
        kind, _, message = line.partition(": ")
        if kind in CROSSING:  # bad input found by the workers (no checkpoint loads: exit 2), a NaN loss (exit 3)
            raise CROSSING[kind](message)
        raise WorkerFailed(f"worker rank {rank} failed (exit {failure.exitcode}): {line}")
    return result.return_values[owner_rank(run.layout)]


# what a rank reports when another rank died under it: the symptom, never the cause
PEER_GONE = ("closed by peer", "reset by peer", "remote worker crash", "communicator was aborted", "Broken pipe")


def first_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure that names the cause: the first, never a peer that only saw it go (its "connection
    closed by peer" can be recorded first under load); timestamps are whole seconds: ties go to the lower rank."""

    def order(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        return any(words in failure_line(failure) for words in PEER_GONE), failure.timestamp, rank

    return min(failures.items(), key=order)


def supervise(agent: LocalElasticAgent, monitor: LocalMonitor | None = None) -> RunResult:
    """Run the agent in a helper thread, so that this (main) thread keeps the signal handlers (the agent would
    install its own, which only kill the workers): SIGINT, SIGTERM or SIGUSR1 here is forwarded to the workers
    as SIGUSR1, "save and stop" (train/preemption.py); a second Ctrl-C kills them, and so does SIGHUP or
    SIGQUIT (as the agent would), unless ignored (nohup). `monitor` reads the workers' beats: a hang ends the
    group, which the agent restarts (max_restarts) or reports failed."""
    outcome: Future = Future()

    def run_agent() -> None:
        # Blocked in this thread, hence in the workers it starts until they are ready for them
        # (train/preemption.py): a terminal's Ctrl-C or an early SIGUSR1 must not kill a starting worker.
        # multiprocessing's resource tracker first: starting it unblocks SIGINT and SIGTERM in its thread.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            outcome.set_result(agent.run())
        except BaseException as err:  # handed to the main thread, which raises it
            outcome.set_exception(err)

    stop = PreemptionFlag(STOP_SIGNALS)
    main = threading.current_thread() is threading.main_thread()  # only there can handlers be set
    hangup = [sig for sig in (signal.SIGHUP, signal.SIGQUIT) if main and signal.getsignal(sig) != signal.SIG_IGN]
    hangup_before = {sig: signal.signal(sig, stop_at_once) for sig in hangup}
    forwarded: set[int] = set()
    quiet_agent_logs()
    try:
        threading.Thread(target=run_agent, name="elastic-agent", daemon=True).start()
        while True:
            try:
                return outcome.result(timeout=0.1)
            except FutureTimeout:
                if stop.raised:  # each poll, so that a group the agent restarts after the signal gets it too
                    signal_workers(agent, signal.SIGUSR1, forwarded)
                if monitor:
                    monitor.poll(agent)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without saving
        kill_workers(agent, outcome)
        raise
    finally:
        stop.restore()
        for sig, handler in hangup_before.items():
            signal.signal(sig, handler)


def stop_at_once(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def local_agent(run: Run, run_dir: Path) -> LocalElasticAgent:
    """PyTorch's elastic agent for `run_rank` on this machine, built as `elastic_launch` builds it, but
    kept at hand: its worker group names the worker processes and its rendezvous can be closed."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    rendezvous = RendezvousParameters("c10d", "127.0.0.1:0", uuid.uuid4().hex, min_nodes=1, max_nodes=1)
    spec = WorkerSpec(
        role="worker",
        local_world_size=run.layout.world_size,
        rdzv_handler=get_rendezvous_handler(rendezvous),
        entrypoint=run_rank,
        args=(run, run_dir),
        max_restarts=run.max_restarts,  # a restarted group resumes from the newest complete checkpoint
        monitor_interval=0.1,
    )
    return LocalElasticAgent(spec, DefaultLogsSpecs(), start_method="forkserver")


def signal_workers(agent: LocalElasticAgent, sig: int, done: set[int]) -> None:
    """Send `sig` once to each worker process the agent runs now (a restarted group has new ones)."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    group = agent.get_worker_group()
    if group.state != WorkerState.HEALTHY:  # starting or stopping: its ids are not running workers
        return
    for pid in {worker.id for worker in group.workers} - done - {None}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        done.add(pid)


def kill_workers(agent: LocalElasticAgent, outcome: Future, wait_s: float = 10.0) -> None:
    """Stop at once: close the rendezvous, so that the agent ends instead of restarting the group it
    sees fail, and kill the workers until it has ended."""
    agent.get_worker_group().spec.rdzv_handler.set_closed()
    killed: set[int] = set()
    deadline = time.monotonic() + wait_s
    logging.disable(logging.ERROR)  # torch reports each death it sees, with a traceback: not news here
    try:
        while not outcome.done() and time.monotonic() < deadline:
            signal_workers(agent, signal.SIGKILL, killed)
            time.sleep(0.05)
    finally:
        logging.disable(logging.NOTSET)


def launch(run: Run, run_dir: Path) -> dict[str, Any]:
    """Run every rank of `run.layout`; its prediction (the planner's) goes into the run's summary."""
    skip_final_collections()
    if run.ft.on and run.replica is None:  # ft: the Lighthouse and the replica groups, each launched here
        return launch_replicas(run, run_dir, launch)
    if env_rank() is not None:
        return run_rank(run, run_dir)
    if run.layout.world_size == 1 and run.replica is None:  # ft: a group of one rank is restarted by its agent
        return train_rank(run, run_dir, 0)
    return start_local_workers(run, run_dir)
