"""SLURM, inside a job: the side that runs in every task (beside spawn.py, which asks for it).

- Each task is one rank (`launcher.launch.rank_env.env_rank`); `rendezvous` gives the address every task agrees
  on without talking: the first host of the node list and a port from the job id.
- On SIGTERM/SIGUSR1 the worker checkpoints and stops; `requeue` then puts the job back in the queue
  (submitit's checkpoint/requeue under submitit, `scontrol requeue` in a plain sbatch job).

The submission side (resources, preflight, sbatch scripts) is launcher/launch/slurm.py. No torch here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from launcher.compat.hydra_compat import submitit_requeue_signal
from launcher.config.ft import REPLICA_ENV

PORT_BASE, PORT_SPAN = 20000, 20000
STEP_PORT_STRIDE = 4099  # a prime not dividing PORT_SPAN: every step of a job gets a port of its own
REQUEUE_WAIT_S = 120.0  # how long a task other than rank 0 waits for the requeue to stop it


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[01-03,7],gpu5` -> ['node01', 'node02', 'node03', 'node7', 'gpu5'] (SLURM's compact form)."""
    hosts: list[str] = []
    for group in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", group)
        if not match:
            hosts.append(group)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


def rendezvous(env: dict[str, str] | os._Environ = os.environ) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT for the tasks of one SLURM job step: the first host of the step's node
    list (127.0.0.1 on a single node) and a port derived from the job and step ids, so every task computes
    the same and the steps of one job (ft's replica groups, on one node) do not meet."""
    listed = [env.get(name, "") for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")]
    nodes = expand_nodelist(next((nodes for nodes in listed if nodes), ""))
    addr = nodes[0] if len(nodes) > 1 else "127.0.0.1"
    job, step = env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", "0")  # the batch step's id: "batch"
    if not job.isdigit():
        return addr, PORT_BASE
    offset = int(job) + (int(step) * STEP_PORT_STRIDE if step.isdigit() else 0)
    return addr, PORT_BASE + offset % PORT_SPAN


def step_replica() -> int | None:
    """ft under SLURM: the replica group this job step runs (set by the emitted script); else None."""
    replica = os.environ.get(REPLICA_ENV)
    return int(replica) if replica else None


def export_rendezvous() -> None:
    """Set MASTER_ADDR/MASTER_PORT from the SLURM environment unless already set (torchrun, the user)."""
    addr, port = rendezvous()
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))


def requeue() -> bool:
    """After the worker checkpointed on SIGTERM/SIGUSR1: put this SLURM job back in the queue (task 0
    only). Under submitit, its own handler does it (it pickles the job for the rerun, requeues and
    exits); in a plain sbatch job, `scontrol requeue`. False outside SLURM."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = (
        f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        if job
        else os.environ.get("SLURM_JOB_ID")
    )
    if not job_id:
        return False
    if os.environ.get("SLURM_PROCID", "0") != "0" or step_replica():
        # Rank 0 (of group 0, under ft) requeues, and the requeue ends this step. Exiting first could end
        # the step before rank 0 has asked (srun --kill-on-bad-exit stops every task when one exits non-zero), so
        # wait for SLURM's SIGTERM, bounded in case rank 0 fails to requeue.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(REQUEUE_WAIT_S)
        return True
    submitit_signal = submitit_requeue_signal()
    if submitit_signal is not None:
        os.kill(os.getpid(), submitit_signal)  # submitit's handler checkpoints, requeues and exits here
        return True
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode:
        print(f"warning: scontrol requeue {job_id} failed: {done.stderr.strip()}", file=sys.stderr)
        return False
    print(f"requeued SLURM job {job_id}: it resumes from the checkpoint", file=sys.stderr)
    return True
