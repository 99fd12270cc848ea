"""One fresh `train` process, timed from its start to its first step's metrics (benches only)."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def timed_train(cmd: list[str], cwd: Path, env: dict[str, str], run_dir: Path) -> tuple[dict[str, Any], float]:
    """(summary.json of the run, seconds from process start to the first line of metrics.jsonl)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: nobody reads while it runs
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stderr=err, text=True)
        jsonl, first = run_dir / "metrics.jsonl", None
        while proc.poll() is None:
            if first is None and jsonl.exists() and jsonl.stat().st_size:
                first = time.perf_counter() - t0
            time.sleep(0.02)
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd[:3])}... failed ({proc.returncode}): {err.read().strip()[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text()), first or float("nan")
