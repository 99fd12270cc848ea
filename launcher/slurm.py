"""SLURM: job resources from the layout, preflight checks, rendezvous, requeue, and plain sbatch scripts.

- `-m hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml) submits through hydra-submitit-launcher;
  its resources come from the resolver `${slurm_job:KEY}`, computed here from the resolved layout and
  hardware profile (`job_resources`), and every one stays overridable (`hydra.launcher.KEY=...`).
  `SlurmLauncher` checks before anything is submitted (`preflight`) and honours `slurm.dry_run`.
- Inside a job each task is one rank (`launcher.spawn.env_rank`); `rendezvous` gives the address
  every task agrees on without talking: the first host of the node list and a port from the job id.
- On SIGTERM/SIGUSR1 the worker checkpoints and stops; `requeue` then puts the job back in the queue
  (submitit's checkpoint/requeue under submitit, `scontrol requeue` in a plain sbatch job).
- `slurm.emit=true` writes an sbatch script (`emit_script`) that runs the same resolved config.

No torch here: the submitting side stays light.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import OmegaConf

from launcher.config import LauncherError, TrainConfig, make_dir

RESOLVER = "slurm_job"
PORT_BASE, PORT_SPAN = 20000, 20000
REQUEUE_WAIT_S = 120.0  # how long a task other than rank 0 waits for the requeue to stop it


class Refused(CompactHydraException):
    """A LauncherError raised inside Hydra's sweep machinery (launcher, sweeper): Hydra prints just the
    message, and the CLI turns it into its one line, exit 2."""


# --- rendezvous -------------------------------------------------------------------------------------
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


# --- resources --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resources:
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int | None
    timeout_min: int
    partition: str | None
    account: str | None


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) or OmegaConf.is_config(cfg) else getattr(cfg, part)
    return cfg


def tasks_needed(cfg: Any) -> int:
    """Ranks per node the layout asks for (degrees given as ints; `auto` counts as 1)."""
    world = 1
    for key in ("tp", "pp", "dp"):
        value = _get(cfg, key)
        world *= value if isinstance(value, int) and not isinstance(value, bool) else 1
    nodes = _get(cfg, "nodes")
    return -(-world // nodes)


def job_resources(cfg: Any) -> Resources:
    """What one job of `cfg` asks SLURM for: one task per device (cuda: every device of the node;
    cpu: one per rank of the layout), `threads` CPUs per task, the time limit and partition."""
    slurm, hw = _get(cfg, "slurm"), _get(cfg, "hardware")
    cuda = _get(hw, "kind") == "cuda"
    tasks = _get(slurm, "tasks_per_node") or (_get(hw, "devices_per_node") if cuda else tasks_needed(cfg))
    return Resources(
        nodes=_get(cfg, "nodes"),
        tasks_per_node=tasks,
        cpus_per_task=_get(slurm, "cpus_per_task") or _get(cfg, "threads") or (8 if cuda else 1),
        gpus_per_node=tasks if cuda else None,
        timeout_min=_get(slurm, "time_min"),
        partition=_get(slurm, "partition"),
        account=_get(slurm, "account"),
    )


def _resolve(key: str, *, _root_: Any) -> Any:
    return asdict(job_resources(_root_))[key]


def register_resolver() -> None:
    """`${slurm_job:tasks_per_node}` etc. in conf/hydra/launcher/slurm.yaml (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve)


register_resolver()


# --- preflight --------------------------------------------------------------------------------------
def preflight(cfg: Any, tasks_per_node: int, partition: str | None) -> None:
    """Before submitting: the layout fits the nodes, sbatch exists, the partition exists. One line each."""
    hw = _get(cfg, "hardware")
    devices, name = _get(hw, "devices_per_node"), _get(hw, "name")
    need = max(tasks_needed(cfg), tasks_per_node)
    if need > devices:
        raise LauncherError(
            f"the layout needs {need} tasks per node (tp x pp x dp / nodes) but hardware={name} has "
            f"devices_per_node={devices}: raise nodes, lower tp/pp/dp, or pick another hardware profile"
        )
    if shutil.which("sbatch") is None:
        raise LauncherError(
            "hydra/launcher=slurm needs `sbatch` on PATH: run on a SLURM login node, or write a script "
            "with slurm.emit=true"
        )
    if partition:
        names = partitions()
        if partition not in names:
            raise LauncherError(
                f"partition '{partition}' does not exist on this cluster: set slurm.partition to one of "
                f"{', '.join(names) or '(none found)'}"
            )


def partitions() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LauncherError(f"cannot list SLURM partitions (sinfo): {err}") from None
    if out.returncode:
        raise LauncherError(f"cannot list SLURM partitions: sinfo says {out.stderr.strip().splitlines()[-1:]}")
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


# --- requeue ----------------------------------------------------------------------------------------
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
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
        os.kill(os.getpid(), sig)  # submitit's checkpoint_and_try_requeue runs here and exits
        return True
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode:
        print(f"warning: scontrol requeue {job_id} failed: {done.stderr.strip()}", file=sys.stderr)
        return False
    print(f"requeued SLURM job {job_id}: it resumes from the checkpoint", file=sys.stderr)
    return True


# --- sbatch script ------------------------------------------------------------------------------------
def sbatch_header(res: Resources, name: str, output: str, signal_delay_s: int) -> list[str]:
    lines = [
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={res.nodes}",
        f"#SBATCH --ntasks-per-node={res.tasks_per_node}",
        f"#SBATCH --cpus-per-task={res.cpus_per_task}",
        f"#SBATCH --time={res.timeout_min}",
        f"#SBATCH --output={output}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=USR1@{signal_delay_s}",
        "#SBATCH --requeue",
    ]
    if res.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={res.gpus_per_node}")
    if res.partition:
        lines.append(f"#SBATCH --partition={res.partition}")
    if res.account:
        lines.append(f"#SBATCH --account={res.account}")
    return lines


def train_command() -> list[str]:
    exe = Path(sys.executable).parent / "train"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from launcher.cli import train; train()"]


def render_script(cfg: TrainConfig, run_dir: Path, config_file: Path) -> str:
    res = job_resources(cfg)
    header = sbatch_header(res, f"train-{cfg.model.name}", str(run_dir / "slurm-%j.out"), cfg.slurm.signal_delay_s)
    command = [*train_command(), "--config-dir", str(config_file.parent), "--config-name", config_file.stem]
    return "\n".join(
        [
            "#!/bin/bash",
            "# Written by `train slurm.emit=true`: one task per device, each task one rank of the layout;",
            "# on SIGUSR1 (time limit) or SIGTERM (preemption) it checkpoints and requeues itself.",
            *header,
            "set -euo pipefail",
            f"cd {shlex.quote(os.getcwd())}",
            f"export OMP_NUM_THREADS={res.cpus_per_task}",
            "srun --kill-on-bad-exit=1 " + shlex.join(command),
            "",
        ]
    )


def emit_script(cfg: TrainConfig, run_dir: Path) -> Path:
    """Write the resolved config and an sbatch script that runs it; return the script's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    frozen = replace(cfg, run_dir=str(run_dir), slurm=replace(cfg.slurm, emit=False, dry_run=False))
    node = OmegaConf.structured(frozen)
    body = OmegaConf.to_yaml(node, resolve=True)
    hydra = {"hydra": {"run": {"dir": str(run_dir)}, "job": {"chdir": False}, "output_subdir": ".hydra"}}
    config_file = run_dir / "slurm_config.yaml"
    config_file.write_text(
        "# The resolved config of `train slurm.emit=true` (run by job.sbatch)\n"
        "defaults:\n  - base_train\n  - _self_\n\n" + OmegaConf.to_yaml(OmegaConf.create(hydra)) + body
    )
    script = Path(cfg.slurm.script) if cfg.slurm.script else run_dir / "job.sbatch"
    make_dir(script.parent, "slurm.script")
    script.write_text(render_script(cfg, run_dir, config_file))
    script.chmod(0o755)
    return script


def describe(params: dict[str, Any], job_overrides: Any, initial_job_idx: int) -> None:
    """`slurm.dry_run=true`: print the sbatch script submitit would submit, and each job's overrides."""
    from submitit.slurm.slurm import _make_sbatch_string

    skip = {"submitit_folder", "max_num_timeout", "name", "mem_gb", "additional_parameters", "_target_"}
    mapped = {"tasks_per_node": "ntasks_per_node", "timeout_min": "time"}
    args = {mapped.get(k, k): v for k, v in params.items() if k not in skip and v is not None}
    text = _make_sbatch_string(
        command="python -u -m submitit.core._submit <folder>",
        folder=str(params["submitit_folder"]),
        job_name=str(params.get("name")),
        map_count=len(job_overrides) if len(job_overrides) > 1 else None,
        additional_parameters=dict(params.get("additional_parameters") or {}),
        **args,
    )
    print(f"dry run: would submit {len(job_overrides)} job(s) with this sbatch script (nothing submitted)")
    print(text)
    for i, overrides in enumerate(job_overrides):
        print(f"  #{initial_job_idx + i}: {' '.join(overrides)}")


def job_task(cfg: Any) -> None:
    """What each SLURM task runs: `train` on the job's config. The CLI's own task function is a closure
    over the terminal (not picklable), so the launcher ships this one instead."""
    from launcher.cli import train_task

    try:
        train_task(OmegaConf.to_object(cfg))
    except LauncherError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
