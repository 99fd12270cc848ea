"""SLURM, inside a job: the side that runs in every task (beside spawn.py, which asks for it).

- Each task is one rank (`launcher.spawn.env_rank`); `rendezvous` gives the address every task agrees
  on without talking: the first host of the node list and a port from the job id.
- On SIGTERM/SIGUSR1 the worker checkpoints and stops; `requeue` then puts the job back in the queue
  (submitit's checkpoint/requeue under submitit, `scontrol requeue` in a plain sbatch job).

The submission side (resources, preflight, sbatch scripts) is launcher/slurm.py. No torch here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from launcher.hydra_compat import submitit_requeue_signal

PORT_BASE, PORT_SPAN = 20000, 20000
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
    """MASTER_ADDR and MASTER_PORT for the tasks of one SLURM job: the first host of the node list
    (127.0.0.1 on a single node) and a port derived from the job id, so every task computes the same."""
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", "") or env.get("SLURM_NODELIST", ""))
    addr = nodes[0] if len(nodes) > 1 else "127.0.0.1"
    job = env.get("SLURM_JOB_ID", "0")
    port = PORT_BASE + int(job) % PORT_SPAN if job.isdigit() else PORT_BASE
    return addr, port


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
    if os.environ.get("SLURM_PROCID", "0") != "0":
        # Rank 0 requeues, and the requeue ends this step. Exiting first could end the step before
        # rank 0 has asked (srun --kill-on-bad-exit stops every task when one exits non-zero), so
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
