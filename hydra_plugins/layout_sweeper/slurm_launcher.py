"""`hydra/launcher=slurm` (launcher/conf/hydra/launcher/slurm.yaml): hydra-submitit-launcher's SLURM launcher,
with the project's preflight checks first (launcher/launch/slurm.py) and `slurm.dry_run=true` submitting nothing.
Hydra only instantiates plugins from the hydra_plugins package, hence this thin class here."""

from typing import Any

from omegaconf import OmegaConf

from launcher.config.extras import installed
from launcher.launch.slurm import describe, preflight


def job_task(cfg: Any) -> None:
    """What each SLURM task runs: `train` on the job's config. A failure is recorded by the sweep point
    (launcher/launch/sweep.py). The CLI's own task function is a closure (not picklable): this one is shipped."""
    from launcher.launch.cli import train_task

    train_task(OmegaConf.to_object(cfg))


# Hydra imports every plugin module: on a minimal install (no submitit) this one defines nothing, and
# `hydra/launcher=slurm` stops at composition with one line naming the extra (launcher/launch/cli.py)
if installed("hydra_plugins.hydra_submitit_launcher"):
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher

    class SlurmLauncher(SubmititSlurmLauncher):
        def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
            super().setup(hydra_context=hydra_context, task_function=job_task, config=config)

        def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
            assert self.config is not None
            # a LauncherError here reaches the CLI as it is (hydra_compat.hydra_errors_raised): one line, exit 2
            dry = self.config.slurm.dry_run
            preflight(self.config, int(self.params.get("tasks_per_node") or 1), self.params.get("partition"), not dry)
            if dry:
                describe(self.params, job_overrides, initial_job_idx)
                return []
            return super().launch(job_overrides, initial_job_idx)
