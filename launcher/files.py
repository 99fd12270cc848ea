"""Files written atomically: into a temporary name of the writer's own, then renamed into place, so a
reader never sees half a file and concurrent writers (processes, or threads of one) never share one."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


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


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` as indented JSON, atomically (several processes may write the same file at once: the
    calibration cache, a run's summary)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n")
