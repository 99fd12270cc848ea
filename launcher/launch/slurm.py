"""SLURM, the submission side: job resources from the layout, preflight checks, plain sbatch scripts.

- `-m hydra/launcher=slurm` (launcher/conf/hydra/launcher/slurm.yaml) submits through hydra-submitit-launcher;
  its resources come from the resolver `${slurm_job:KEY}`, computed here from the resolved layout and
  hardware profile (`job_resources`), and every one stays overridable (`hydra.launcher.KEY=...`).
  `SlurmLauncher` checks before anything is submitted (`preflight`) and honours `slurm.dry_run`.
- `slurm.emit=true` writes an sbatch script (`emit_script`) that runs the same resolved config.

Inside a job (rendezvous, requeue): launcher/launch/slurm_job.py. No torch here: the submitting side stays light.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher.compat.hydra_compat import SUBMITIT_COMMAND, sbatch_script
from launcher.config.ft import ATTEMPT_ENV, REPLICA_ENV
from launcher.config.layout_keys import given_degrees
from launcher.config.schema import TrainConfig
from launcher.errors import PREEMPTED, LauncherError
from launcher.files import make_dir
from launcher.layout import Layout, fixed_degrees, workers_per_node

RESOLVER = "slurm_job"


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
    """Ranks per node the config's degrees ask for (`auto` counts as 1: the layout rule with a free
    world size). An emitted script's config pins the resolved Layout, so this is its world size."""
    degrees = given_degrees(cfg)
    tp, pp, cp, replicate, shard = fixed_degrees(degrees, None, degrees["ep"] or 1)
    return workers_per_node(tp * pp * cp * replicate * shard, _get(cfg, "nodes"))


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
    """`${slurm_job:tasks_per_node}` etc. in launcher/conf/hydra/launcher/slurm.yaml (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve)


register_resolver()


# --- preflight --------------------------------------------------------------------------------------
def preflight(cfg: Any, tasks_per_node: int, partition: str | None, submits: bool = True) -> None:
    """Before submitting: the layout fits the nodes, sbatch exists, the controller answers and the partition
    exists (`submits`: a dry run asks the controller nothing). One line each."""
    check_ft_steps(_get(cfg, "ft.replicas"), "hydra/launcher=slurm")
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
    names = partitions() if submits else []  # an unreachable controller fails here, not inside submitit
    if partition and submits:
        if partition not in names:
            raise LauncherError(
                f"partition '{partition}' does not exist on this cluster: set slurm.partition to one of "
                f"{', '.join(names) or '(none found)'}"
            )


def check_ft_steps(replicas: int, where: str) -> None:
    """`ft` needs a job step per replica group, which only the emitted script runs: one line elsewhere."""
    if replicas > 1:
        raise LauncherError(
            f"ft.replicas={replicas} under {where}: replica groups run one job step each, which the emitted "
            f"script does: use slurm.emit=true and sbatch its job.sbatch (docs/fault-tolerance.md)"
        )


UNREACHABLE = "SLURM does not answer here"
REACH_FIX = "run on a login node of the cluster (or set SLURM_CONF), or write a script with slurm.emit=true"


def partitions() -> list[str]:
    """The cluster's partitions, asked of its controller (sinfo): one line when it does not answer."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LauncherError(f"{UNREACHABLE} (sinfo: {err}): {REACH_FIX}") from None
    if out.returncode:
        said = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1].removeprefix("sinfo: ")
        raise LauncherError(f"{UNREACHABLE} (sinfo: {said}): {REACH_FIX}")
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


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
    return [sys.executable, "-c", "from launcher.launch.cli import train; train()"]


def render_script(cfg: TrainConfig, run_dir: Path, config_file: Path) -> str:
    res = job_resources(cfg)
    header = sbatch_header(res, f"train-{cfg.model.name}", str(run_dir / "slurm-%j.out"), cfg.slurm.signal_delay_s)
    command = [*train_command(), "--config-dir", str(config_file.parent), "--config-name", config_file.stem]
    run = ft_steps(cfg, res, command, run_dir) if cfg.ft.on else ["srun --kill-on-bad-exit=1 " + shlex.join(command)]
    return "\n".join(
        [
            "#!/bin/bash",
            "# Written by `train slurm.emit=true`: one task per device, each task one rank of the layout;",
            "# on SIGUSR1 (time limit) or SIGTERM (preemption) it checkpoints and requeues itself.",
            *header,
            "set -euo pipefail",
            f"cd {shlex.quote(os.getcwd())}",
            f"export OMP_NUM_THREADS={res.cpus_per_task}",
            *run,
            "",
        ]
    )


def group_nodes(nodes: int, replicas: int) -> tuple[int, int]:
    """ft: the nodes of one replica group and how many groups share a node (1 when groups span nodes).
    A group is whole nodes, or an equal share of one: one line otherwise."""
    if nodes % replicas == 0:
        return nodes // replicas, 1
    if replicas % nodes == 0:
        return 1, replicas // nodes
    raise LauncherError(
        f"ft.replicas={replicas} with nodes={nodes}: under SLURM each replica group takes whole nodes or an equal "
        f"share of one: set nodes to a multiple or a divisor of {replicas}"
    )


def ft_steps(cfg: TrainConfig, res: Resources, command: list[str], run_dir: Path) -> list[str]:
    """ft: the Lighthouse in the batch step (here, on the first node), then one job step per replica group,
    run again alone when it fails (up to max_restarts times) while the others keep stepping."""
    ft = cfg.ft
    group_size, per_node = group_nodes(res.nodes, ft.replicas)
    tasks = res.tasks_per_node * group_size // per_node
    services_file = str(run_dir / "ft_services.sh")
    env_file = shlex.quote(services_file)
    serve = [sys.executable, "-m", "launcher.launch.ft", services_file]
    serve += [f"--{key}={getattr(ft, key)}" for key in ("min_replicas", "quorum_timeout_s", "heartbeat_timeout_s")]
    step = f"srun --exact --kill-on-bad-exit=1 --nodes={group_size} --ntasks={tasks} --relative=$2"
    step += f" --cpus-per-task={res.cpus_per_task}"
    if res.gpus_per_node:
        step += " --gpus-per-task=1"
    return [
        f"rm -f {env_file}",
        shlex.join(serve) + " &",
        "services=$!",
        "trap 'kill \"$services\" 2>/dev/null || true' EXIT",
        f'until [ -s {env_file} ]; do kill -0 "$services"; sleep 0.2; done  # up, or the script stops here',
        f"source {env_file}",
        "group() {  # replica group $1 on the job's nodes from $2: its ranks are one job step, run again when it fails",
        f"  for attempt in $(seq 0 {cfg.max_restarts}); do",
        "    code=0",
        f'    {REPLICA_ENV}="$1" {ATTEMPT_ENV}="$attempt" {step} {shlex.join(command)} || code=$?',
        f'    [ "$code" -eq 0 ] || [ "$code" -eq {PREEMPTED} ] && return "$code"  # done, or saved for the requeue',
        '    echo "replica group $1 failed (exit $code, attempt $attempt)" >&2',
        "  done",
        "  return 1",
        "}",
        "pids=()",
        f'for g in $(seq 0 {ft.replicas - 1}); do group "$g" $((g / {per_node} * {group_size})) & pids+=($!); done',
        "status=0",
        'for pid in "${pids[@]}"; do wait "$pid" || status=1; done',
        'exit "$status"',
    ]


def emit_script(cfg: TrainConfig, run_dir: Path, layout: Layout) -> Path:
    """Write the config with `layout` pinned and an sbatch script that runs it (its resources from
    that layout); return the script's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    node = OmegaConf.structured(replace(cfg, run_dir=str(run_dir), slurm=replace(cfg.slurm, emit=False, dry_run=False)))
    for key, value in layout.settings().items():
        OmegaConf.update(node, key, value)
    frozen: TrainConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    body = OmegaConf.to_yaml(node, resolve=True)
    hydra = {
        "hydra": {"run": {"dir": str(run_dir)}, "job": {"chdir": False, "name": "train"}, "output_subdir": ".hydra"}
    }
    config_file = run_dir / "slurm_config.yaml"
    config_file.write_text(
        "# The resolved config of `train slurm.emit=true` (run by job.sbatch)\n"
        "defaults:\n  - base_train\n  - _self_\n\n" + OmegaConf.to_yaml(OmegaConf.create(hydra)) + body
    )
    script = Path(cfg.slurm.script) if cfg.slurm.script else run_dir / "job.sbatch"
    make_dir(script.parent, "slurm.script")
    script.write_text(render_script(frozen, run_dir, config_file))
    script.chmod(0o755)
    return script


def describe(params: dict[str, Any], job_overrides: Any, initial_job_idx: int) -> None:
    """`slurm.dry_run=true`: print the sbatch script submitit would submit, and each job's overrides."""
    skip = {"submitit_folder", "max_num_timeout", "name", "mem_gb", "additional_parameters", "_target_"}
    mapped = {"tasks_per_node": "ntasks_per_node", "timeout_min": "time"}
    args = {mapped.get(k, k): v for k, v in params.items() if k not in skip and v is not None}
    text = sbatch_script(
        command=f"{SUBMITIT_COMMAND} <folder>",
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
