"""`hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml): hydra-submitit-launcher's SLURM launcher,
with the project's preflight checks first (launcher/slurm.py) and `slurm.dry_run=true` submitting nothing.
Hydra only instantiates plugins from the hydra_plugins package, hence this thin class here."""

from typing import Any

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher

from launcher.config import LauncherError
from launcher.slurm import Refused, describe, job_task, preflight


class SlurmLauncher(SubmititSlurmLauncher):
    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        # `train`'s task function is a closure over the terminal: ship a picklable one to the jobs
        super().setup(hydra_context=hydra_context, task_function=job_task, config=config)

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        assert self.config is not None
        try:
            preflight(self.config, int(self.params.get("tasks_per_node") or 1), self.params.get("partition"))
        except LauncherError as err:
            raise Refused(str(err)) from None
        if self.config.slurm.dry_run:
            describe(self.params, job_overrides, initial_job_idx)
            return []
        return super().launch(job_overrides, initial_job_idx)
