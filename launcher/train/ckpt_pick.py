"""Which checkpoint: the complete ones under a root, newest first (a folder `step_NNNNNNNN/` whose
`complete.json` marker was written last), and the one a run resumes from (`resume=auto|never|PATH`),
checked before any worker starts (launcher/train/checkpoint.py writes and loads them)."""

from __future__ import annotations

import re
from pathlib import Path

from launcher.config.mix import check_resumed_mix, mixture_sources
from launcher.config.schema import DataConfig
from launcher.errors import LauncherError
from launcher.train.ckpt_write import check_owner
from launcher.train.untrusted import UnreadableCheckpoint, read_index, verify

MARKER = "complete.json"
NAME = re.compile(r"step_\d{8}")


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1].split(".")[0])


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and NAME.fullmatch(p.name)]
    return sorted((p for p in found if (p / MARKER).is_file()), key=step_of, reverse=True)


def no_readable(root: Path, failures: list[tuple[Path, str]], fix: str) -> LauncherError:
    path, why = failures[0]
    return LauncherError(
        f"no readable checkpoint under {root} ({len(failures)} found, newest {path.name}: {why}); {fix}"
    )


RESUME_FIX = "resume=PATH picks one; a new run_dir (or checkpoint.dir) starts over"


def preflight_resume(resume: str, root: Path, every_rank: bool = False, data: DataConfig | None = None) -> None:
    """Before any worker starts: a bad resume path, or checkpoints none of which passes `verify`,
    is one line (exit 2); training from step 0 would prune them. `every_rank`: each rank runs this
    (torchrun, SLURM), so each reads only the index and extras, not every rank's files. `data`: the
    run's, which must be able to resume the checkpoint's data position (a mixture's sources)."""
    candidates = resolve_resume(resume, root)
    check_owner(resume, candidates, root, complete_checkpoints(root))
    failures = []
    for path in candidates:
        try:
            _, extras = read_index(path)
            if not every_rank:
                verify(path)
        except UnreadableCheckpoint as err:
            failures.append((path, str(err)))
            continue
        if data is not None:
            labels = [s.label for s in mixture_sources(data)] if data.name == "mix" else None
            check_resumed_mix(extras.get("loader", {}), labels)
        return
    if failures:
        raise no_readable(failures[0][0].parent, failures, RESUME_FIX)


def resolve_resume(resume: str, default_root: Path) -> list[Path]:
    """Candidate checkpoints to resume from, newest first; an explicit path must hold one."""
    if resume == "never":
        return []
    if resume == "auto":
        return complete_checkpoints(default_root)
    path = Path(resume).expanduser()
    if not path.exists():
        raise LauncherError(f"resume={resume}: no such path; give a checkpoint folder, resume=auto or resume=never")
    if (path / MARKER).is_file():
        return [path]
    found = complete_checkpoints(path)
    if not found:
        raise LauncherError(f"resume={resume} holds no complete checkpoint (no step_*/{MARKER}): give another path")
    return found
