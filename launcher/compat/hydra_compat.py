"""Every private Hydra / submitit API the project uses, in one place (PyTorch's: compat/torch_compat.py).

Each is used here for a reason (no public API does the same) and has a test in
tests/unit/test_hydra_compat.py that checks the signature or behaviour the project relies on, so an
upgrade that changes one fails there, loudly, rather than somewhere in a run. Neither library is
imported until an API is used.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any


# --- Hydra --------------------------------------------------------------------------------------------
def basic_sweeper() -> type:
    """Hydra's basic sweeper, which the layout sweeper extends (split_arguments, get_job_batch, is_done,
    validate_batch_is_legal, its `overrides` batches). Looked up when called: Hydra re-executes its
    plugin modules when it scans them, and a class taken before the scan would be a stale copy."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper


FULL_ERROR = "HYDRA_FULL_ERROR"  # Hydra's documented switch; "1": run_and_report re-raises


def hydra_full_error() -> bool:
    """The user asked Hydra for full tracebacks."""
    return os.environ.get(FULL_ERROR) == "1"


@contextlib.contextmanager
def hydra_errors_raised() -> Iterator[Callable[[], None]]:
    """While active, `hydra.main` lets an exception out as the object it is, instead of printing it
    and exiting 1. Yields `restore`, which puts the user's own setting back before the block ends
    (when the task starts: Hydra reports the task's own crashes as the user asked)."""
    old = os.environ.get(FULL_ERROR)

    def restore() -> None:
        if old is None:
            os.environ.pop(FULL_ERROR, None)
        else:
            os.environ[FULL_ERROR] = old

    os.environ[FULL_ERROR] = "1"
    try:
        yield restore
    finally:
        restore()


CONFIG_DIR_FLAGS = ("--config-dir", "-cd")  # hydra.main's flag adding a folder to the config search path


def plain_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of a command line Hydra's parser reads as overrides and --config-dir alone, for the
    compose API; --config-dir DIR as the `hydra.searchpath` override, which puts DIR where the flag does
    (after the app's own folder, before the schema). None for anything else, left to hydra.main as it
    always was: a flag (--help, --cfg, -m), a hydra. or hydra/ override, a missing or unquotable DIR."""
    overrides, folders = [], []
    args = iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_DIR_FLAGS:
            folders.append(value if eq else next(args, ""))
        elif arg.startswith("-") or arg.lstrip("+~").startswith(("hydra.", "hydra/")):
            return None
        else:
            overrides.append(arg)
    if not folders:
        return overrides
    folder = os.path.abspath(folders[-1])
    if len(folders) > 1 or not folders[-1] or not os.path.isdir(folder) or "'" in folder or "\\" in folder:
        return None  # Hydra's own message for a missing folder
    return [*overrides, f"hydra.searchpath=['file://{folder}']"]


# --- submitit -----------------------------------------------------------------------------------------
SUBMITIT_COMMAND = "python -u -m submitit.core._submit"  # what a submitit job runs (for the dry run)


def sbatch_script(**params: Any) -> str:
    """The sbatch script submitit would submit for these executor parameters (`slurm.dry_run`);
    submitit writes it only as part of a submission."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(**params)


def submitit_requeue_signal() -> signal.Signals | None:
    """Inside a submitit SLURM job, the signal on which submitit's own handler checkpoints the job,
    requeues it and exits (SUBMITIT_PREEMPT_SIGNAL, USR2 by default); None elsewhere."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    from submitit.core.job_environment import JobEnvironment

    return signal.Signals["SIG" + JobEnvironment.USR_SIG]
