"""The `slurm_cluster` fixture: a real single-node SLURM (scripts/slurm_up.sh), once per test session.

Tests that use it are marked `slurm`. They are skipped, with the reason, only where the packages
cannot be installed (not root, no apt); any other failure to start the cluster is an error.
The cluster is stopped at the end of the session if this session started it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_INSTALLABLE = 3  # slurm_up.sh: the packages are missing and cannot be installed


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[str]:
    """Start (or reuse) the throw-away cluster; SLURM_CONF is exported for the session. Yields its path."""
    up = subprocess.run([str(ROOT / "scripts" / "slurm_up.sh")], capture_output=True, text=True, timeout=600)
    if up.returncode == NOT_INSTALLABLE:
        pytest.skip(f"SLURM packages cannot be installed here: {up.stderr.strip().splitlines()[-1]}")
    if up.returncode:
        pytest.fail(f"scripts/slurm_up.sh failed (exit {up.returncode}):\n{up.stderr[-3000:]}")
    conf = up.stdout.strip().split("SLURM_CONF=", 1)[1]
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if "already running" not in up.stderr:
            subprocess.run([str(ROOT / "scripts" / "slurm_down.sh")], capture_output=True, timeout=120)


def slurm(*args: str) -> str:
    """Run a SLURM client command against the cluster; its stdout."""
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout


def job_state(job_id: str) -> str:
    """The job's state from accounting (sacct), e.g. PENDING, RUNNING, COMPLETED, FAILED."""
    lines = slurm("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State").split()
    return lines[0].split()[0] if lines else "UNKNOWN"


def wait_for(predicate, timeout: float, what: str, every: float = 0.5):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
