"""SLURM: submitted through the launcher to a real single-node cluster (tests/slurm_fixture.py), the
emitted sbatch script, preemption and requeue; and the bad input that must submit nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.errors import LauncherError
from launcher.launch.slurm import emit_script, group_nodes, job_resources, preflight
from launcher.launch.slurm_job import expand_nodelist, rendezvous
from launcher.planner import resolve
from launcher.train.faults import TEST_KILL_ENV
from tests.conftest import make_config, run_cli, tiny_args, tiny_config
from tests.slurm_fixture import job_state, slurm, slurm_cluster, wait_for  # noqa: F401  (fixture)

TRAIN = str(Path(sys.executable).parent / "train")


def on_cluster(test):  # noqa: ANN001, ANN201
    """Marked `slurm`, and run with the cluster of tests/slurm_fixture.py up."""
    return pytest.mark.slurm(pytest.mark.usefixtures("slurm_cluster")(test))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def sweep_dir(out: Path) -> Path:
    (found,) = [p for p in out.glob("*/*") if p.is_dir()]
    return found


def steps_of(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- pure: no cluster ---------------------------------------------------------------------------------
def test_nodelist_and_rendezvous() -> None:
    assert expand_nodelist("node[01-03,7],gpu5") == ["node01", "node02", "node03", "node7", "gpu5"]
    assert expand_nodelist("a1") == ["a1"]
    env = {"SLURM_JOB_NODELIST": "gpu[08-09]", "SLURM_JOB_ID": "1234"}
    assert rendezvous(env) == ("gpu08", 21234)
    assert rendezvous({"SLURM_JOB_NODELIST": "vm", "SLURM_JOB_ID": "7"})[0] == "127.0.0.1"
    # a job step (ft's replica group): its own nodes, and a port of its own among the job's steps
    step = {**env, "SLURM_STEP_NODELIST": "gpu09", "SLURM_STEP_ID": "1"}
    assert rendezvous(step) == ("127.0.0.1", 20000 + (1234 + 4099) % 20000)
    assert rendezvous({**step, "SLURM_STEP_NODELIST": "gpu[10-11]"}) == ("gpu10", 25333)


def test_resources_from_layout_and_hardware() -> None:
    res = job_resources(make_config("tp=2", "threads=1", "slurm.partition=debug"))
    assert (res.nodes, res.tasks_per_node, res.cpus_per_task, res.gpus_per_node) == (1, 2, 1, None)
    gpu = job_resources(make_config("+model=8b", "hardware=h100_sxm", "nodes=2", "tp=8"))
    assert (gpu.nodes, gpu.tasks_per_node, gpu.gpus_per_node) == (2, 8, 8)


@pytest.mark.slow
def test_too_many_tasks_per_node_is_one_line(tmp_path: Path, cache: str) -> None:
    cfg = make_config("+model=8b", "hardware=h100_sxm", "tp=16")
    with pytest.raises(LauncherError, match="needs 16 tasks per node .* devices_per_node=8"):
        preflight(cfg, 8, None)
    out = run_cli(
        "train", "-m", "hydra/launcher=slurm", *tiny_args(cache), "tp=2", "hardware.devices_per_node=1", cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: the layout needs 2 tasks per node")
    assert not list(tmp_path.glob("*/*/.submitit"))


@pytest.mark.slow
def test_no_sbatch_on_path_is_one_line(tmp_path: Path, cache: str) -> None:
    env = {"PATH": str(Path(sys.executable).parent)}
    out = run_cli("train", "-m", "hydra/launcher=slurm", *tiny_args(cache), env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs `sbatch` on PATH" in lines[0], out.stderr
    assert not list(tmp_path.glob("*/*/.submitit"))


def test_emitted_script(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "tp=2", "slurm.partition=debug", "slurm.time_min=5")
    script = emit_script(cfg, tmp_path / "run", resolve(cfg)[0])
    text = script.read_text()
    for line in ("--ntasks-per-node=2", "--cpus-per-task=1", "--partition=debug", "--time=5", "--signal=USR1@"):
        assert line in text
    assert "srun --kill-on-bad-exit=1" in text and "--config-name slurm_config" in text
    pinned = (tmp_path / "run" / "slurm_config.yaml").read_text()
    assert "tp: 2" in pinned and "dp: 1" in pinned and "microbatches: 1" in pinned  # the resolved Layout


def test_a_gpu_job_script_is_written_on_a_machine_without_a_gpu(tmp_path: Path) -> None:
    """Login nodes, where job scripts are written, have no GPU: the CUDA checks belong to the job."""
    from launcher.launch.cli import train_task

    run = tmp_path / "run"
    cfg = tiny_config(tmp_path, "hardware=h100_sxm", "nodes=2", "tp=2", "slurm.emit=true", f"run_dir={run}")
    from launcher.launch.rank_env import CUDA_ENV

    names = [name for group in CUDA_ENV for name in group]
    before = {name: os.environ.get(name) for name in names}
    train_task(cfg)
    assert {name: os.environ.get(name) for name in names} == before  # no CUDA run's settings in this process
    text = (run / "job.sbatch").read_text()
    assert "--nodes=2" in text and "--gpus-per-node=8" in text, text


def test_replica_groups_take_whole_nodes_or_a_share_of_one() -> None:
    assert group_nodes(4, 2) == (2, 1) and group_nodes(1, 2) == (1, 2) and group_nodes(2, 4) == (1, 2)
    with pytest.raises(LauncherError, match="ft.replicas=2 with nodes=3: .* set nodes to a multiple or a divisor"):
        group_nodes(3, 2)


FT_LAYOUT = ("dp=2", "dp_replicate=2", "dp_shard=1", "ft.replicas=2")


def test_ft_outside_the_emitted_script_is_one_line(tmp_path: Path) -> None:
    """Submitit's job (one step of every rank) cannot run replica groups: refused before submitting."""
    with pytest.raises(LauncherError, match=r"ft.replicas=2 under hydra/launcher=slurm: .* use slurm.emit=true") as err:
        preflight(make_config(*FT_LAYOUT), 2, None)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_ft_in_a_step_of_every_rank_is_one_line(tmp_path: Path, cache: str) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}  # as torchrun (or submitit's step) would start it
    out = run_cli("train", *tiny_args(cache), *FT_LAYOUT, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: ft.replicas=2 under torchrun or one SLURM job step of every rank: replica groups run one job step"
        )
    )


def test_emitted_ft_script_runs_one_step_per_group(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, *FT_LAYOUT, "max_restarts=2")
    text = emit_script(cfg, tmp_path / "run", resolve(cfg)[0]).read_text()
    assert "--ntasks-per-node=2" in text  # the job holds every group's ranks
    assert "-m launcher.launch.ft" in text and f"source {tmp_path / 'run' / 'ft_services.sh'}" in text
    assert "srun --exact --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --relative=$2" in text
    assert "for attempt in $(seq 0 2)" in text and "for g in $(seq 0 1)" in text


# --- on the cluster -------------------------------------------------------------------------------------
@pytest.mark.slow
@on_cluster
def test_partition_that_does_not_exist(tmp_path: Path, cache: str) -> None:
    before = slurm("squeue", "-h", "-o", "%i")
    out = run_cli("train", "-m", "hydra/launcher=slurm", *tiny_args(cache), "slurm.partition=nope", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "error: partition 'nope' does not exist on this cluster: set slurm.partition to one of debug"
    )
    assert slurm("squeue", "-h", "-o", "%i") == before


@pytest.mark.slow
@on_cluster
def test_dry_run_submits_nothing(tmp_path: Path, cache: str) -> None:
    out = run_cli(
        "train", "-m", "hydra/launcher=slurm", *tiny_args(cache), "tp=2", "seed=1,2", "slurm.dry_run=true", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "would submit 2 job(s)" in out.stdout and "#SBATCH --ntasks-per-node=2" in out.stdout
    assert "#SBATCH --array=0-1%2" in out.stdout
    assert not list(tmp_path.glob("*/*/.submitit"))


@pytest.mark.slow
@on_cluster
def test_two_task_job_trains(tmp_path: Path, cache: str) -> None:
    out = run_cli(
        "train", "-m", "hydra/launcher=slurm", *tiny_args(cache), "tp=2", "slurm.partition=debug", cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr
    run = sweep_dir(tmp_path) / "0"
    assert steps_of(run) == [1, 2, 3, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["layout"]["tp"] == 2
    assert (run / "rank0.log").exists() and (run / "rank1.log").exists()  # two SLURM tasks, one rank each
    (job,) = [p.name for p in (sweep_dir(tmp_path) / ".submitit").iterdir() if p.is_dir()]
    wait_for(lambda: job_state(job) == "COMPLETED", 30, f"job {job} to be COMPLETED in accounting")


@pytest.mark.slow
@on_cluster
def test_layout_sweep_as_job_array(tmp_path: Path, cache: str) -> None:
    out = run_cli(
        "train",
        "-m",
        "hydra/launcher=slurm",
        *tiny_args(cache),
        "hydra.launcher.tasks_per_node=2",
        "tp=1,2",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    sweep = sweep_dir(tmp_path)
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert [(r["layout"], r["status"]) for r in rows] == [("tp1 pp1 dp2 fsdp", "ok"), ("tp2 pp1 dp1", "ok")]
    assert (sweep / "sweep_summary.png").stat().st_size > 0
    (array,) = {p.name.split("_")[0] for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name}
    states = lambda: sorted(slurm("sacct", "-n", "-X", "-P", "-j", array, "-o", "JobID,State").split())  # noqa: E731
    wait_for(lambda: states() == [f"{array}_0|COMPLETED", f"{array}_1|COMPLETED"], 30, f"array {array}: {states()}")


def signal_and_release(job: str) -> None:
    """USR1 to the job's tasks (what SLURM sends before the time limit); once it is requeued, start it
    again without SLURM's ~2 min hold, but not within the second its credential was revoked in:
    slurmd compares whole seconds and kills a rerun started then ("Job credential revoked")."""
    slurm("scancel", "--signal=USR1", job)
    pending = lambda: slurm("squeue", "-h", "-j", job, "-o", "%T").strip() == "PENDING"  # noqa: E731
    wait_for(pending, 60, f"job {job} to be requeued")
    time.sleep(1.5)
    slurm("scontrol", "update", f"jobid={job}", "StartTime=now")


def assert_resumed(run: Path, job: str, steps: int) -> None:
    """Every step trained exactly once across the two runs, and SLURM ran the job twice."""
    seen = steps_of(run)
    assert seen[-1] == steps and sorted(set(seen)) == list(range(1, steps + 1))  # resumed after the checkpoint
    assert len(seen) == steps  # nothing trained twice: the rerun started after the saved step
    wait_for(lambda: job_state(job) == "COMPLETED", 30, f"job {job} to be COMPLETED in accounting")
    assert "Restarts=1" in slurm("scontrol", "show", "job", job)
    assert json.loads((run / "summary.json").read_text())["steps"] == steps


@pytest.mark.slow
@on_cluster
def test_signalled_job_is_requeued_and_resumes(tmp_path: Path, cache: str) -> None:
    """USR1 mid-run (what SLURM sends before the time limit): checkpoint, submitit requeues, the rerun resumes."""
    env = {**os.environ, "LAUNCHER_OUTPUTS": str(tmp_path)}
    args = [TRAIN, "-m", "hydra/launcher=slurm", *tiny_args(cache, steps=150), "tp=2", "checkpoint.every=1000"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run = wait_for(lambda: next(iter(tmp_path.glob("*/*/0/metrics.jsonl")), None), 120, "training to start").parent
        wait_for(lambda: len(steps_of(run)) >= 5, 60, "5 steps")
        (job,) = [p.name for p in (run.parent / ".submitit").iterdir() if p.is_dir()]
        signal_and_release(job)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert_resumed(run, job, 150)


@pytest.mark.slow
@on_cluster
def test_emitted_script_runs_under_sbatch(tmp_path: Path, cache: str) -> None:
    run = tmp_path / "run"
    out = run_cli("train", *tiny_args(cache), "tp=2", "slurm.emit=true", f"run_dir={run}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    script = Path(out.stdout.strip().splitlines()[-1])
    assert script == run / "job.sbatch" and not (run / "metrics.jsonl").exists()  # written, not run
    job = slurm("sbatch", "--parsable", str(script)).strip()
    state = wait_for(
        lambda: (s := job_state(job)) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, 120, "the sbatch job"
    )
    assert state == "COMPLETED", (run / f"slurm-{job}.out").read_text()
    assert steps_of(run) == [1, 2, 3, 4]
    assert json.loads((run / "summary.json").read_text())["layout"]["tp"] == 2


@pytest.mark.slow
@on_cluster
def test_emitted_script_requeues_on_signal_and_resumes(tmp_path: Path, cache: str) -> None:
    """The plain sbatch path: rank 0 runs `scontrol requeue`, the other rank waits to be stopped
    (exiting first would let `srun --kill-on-bad-exit` end the step before the requeue)."""
    run = tmp_path / "run"
    args = [*tiny_args(cache, steps=150), "tp=2", "checkpoint.every=1000", "slurm.emit=true", f"run_dir={run}"]
    out = run_cli("train", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = slurm("sbatch", "--parsable", out.stdout.strip().splitlines()[-1]).strip()
    wait_for(lambda: (run / "metrics.jsonl").exists() and len(steps_of(run)) >= 5, 120, "5 steps")
    signal_and_release(job)
    state = wait_for(
        lambda: (s := job_state(job)) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, 180, "the rerun"
    )
    assert state == "COMPLETED", (run / f"slurm-{job}.out").read_text()
    assert_resumed(run, job, 150)


@pytest.mark.slow
@on_cluster
def test_ft_groups_are_job_steps_and_a_failed_one_heals(tmp_path: Path, cache: str) -> None:
    """The emitted ft script: the Lighthouse in the batch step, each group a job step. Group 1's worker dies
    at step 3 (first attempt); the script starts its step again, it heals from group 0 and both end bitwise
    equal. min_replicas=2: group 0 waits for it (it would otherwise finish alone before the new step is up)."""
    from tests.unit.test_ft import assert_same, final_state

    run = tmp_path / "run"
    ft = ("ft.min_replicas=2", "ft.quorum_timeout_s=60", "max_restarts=1", "checkpoint.every=40")
    args = [*tiny_args(cache, steps=40), *FT_LAYOUT, *ft, "metrics.log_every=1", "slurm.emit=true", f"run_dir={run}"]
    out = run_cli("train", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    env = {**os.environ, TEST_KILL_ENV: "3:1"}  # sbatch passes the environment on to the job
    submitted = subprocess.run(
        ["sbatch", "--parsable", out.stdout.strip().splitlines()[-1]], env=env, capture_output=True, text=True
    )
    job = submitted.stdout.strip()
    state = wait_for(
        lambda: (s := job_state(job)) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, 180, "the ft job"
    )
    log = (run / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert "replica group 1 failed (exit 1, attempt 0)" in log
    rows = [line.split("|") for line in slurm("sacct", "-n", "-P", "-j", job, "-o", "JobID,State").split()]
    groups = sorted(state for step, state in rows if step.split(".")[-1].isdigit() and "." in step)
    assert groups == ["COMPLETED", "COMPLETED", "FAILED"], rows  # 3 job steps: group 1's was started twice
    assert steps_of(run) == list(range(1, 41))  # group 0: each step once, never restarted
    assert steps_of(run / "replica_1") == list(range(1, 41))  # group 1: steps 1-2, died, healed into step 3
    assert_same(final_state(run), final_state(run / "replica_1"))


def test_a_slurm_that_does_not_answer_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch installed but no controller (no slurm.conf, DNS SRV lookup failed): submitit's 65-line
    traceback before; one line naming the fix now, and a dry run still prints its script."""
    import launcher.launch.slurm as slurm_module

    said = "sinfo: fatal: Could not establish a configuration source"
    failed = subprocess.CompletedProcess(["sinfo"], 1, stdout="", stderr=f"sinfo: error: x\n{said}\n")
    monkeypatch.setattr(slurm_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm_module.subprocess, "run", lambda *a, **k: failed)
    cfg = make_config("threads=1")
    with pytest.raises(LauncherError) as err:
        preflight(cfg, 1, None)
    assert str(err.value) == (
        "SLURM does not answer here (sinfo: fatal: Could not establish a configuration source): run on a login "
        "node of the cluster (or set SLURM_CONF), or write a script with slurm.emit=true"
    )
    preflight(cfg, 1, "debug", submits=False)  # slurm.dry_run: nothing asked of the controller
