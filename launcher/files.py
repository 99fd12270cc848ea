"""Files written atomically: into a temporary name of the writer's own, then renamed into place, so a
reader never sees half a file and concurrent writers (processes, or threads of one) never share one;
and the directories a run writes into, created or refused in one line; a path as the user reads it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from launcher.errors import LauncherError


def temp_beside(path: Path) -> Path:
    """A temporary name in `path`'s directory that only this thread of this process uses (the pid
    alone is shared by threads: two of them renamed one file and the second found it gone)."""
    return path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def write_atomic(path: Path, data: bytes | str) -> None:
    tmp = temp_beside(path)
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def shared_mode(path: Path) -> None:
    """`path` readable as a file the user created is (0666 less the umask): safetensors writes 0600, and
    exported weights are made to be read by others (a serving job, a colleague)."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def make_dir(path: Path, key: str) -> None:
    """Create a directory the run writes into, or say in one line why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LauncherError(
            f"{key}: cannot create the directory {path} ({err.strerror}): choose another {key}"
        ) from None
    if not os.access(path, os.W_OK):
        raise LauncherError(f"{key}: the directory {path} is not writable: choose another {key}")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` as indented JSON, atomically (several processes may write the same file at once: the
    calibration cache, a run's summary)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def shown(path: Path) -> str:
    """`path` as the user reads it: relative to the working directory when under it."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


HYDRA_ONLY = {".hydra", "train.log", ".lock"}  # what Hydra and the run lock write before the run does


def remove_if_unused(run_dir: Path, dated: bool) -> bool:
    """Remove a run directory that holds nothing the run wrote (a dry run, bad input), and with
    `dated` (Hydra's outputs/DATE/TIME) its parents left empty, so `outputs/` collects only runs."""
    import shutil

    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - HYDRA_ONLY:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in list(run_dir.parents)[:2] if dated else []:
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
    return True
