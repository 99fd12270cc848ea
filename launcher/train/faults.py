"""Test-only fault injection: the one place that reads and parses the test fault plan.

Tests inject faults through five environment variables, one per fault, each read here only:

- `LAUNCHER_TEST_NAN=STEP[:RANK]`: that rank's forward output at STEP is NaN (guard.py).
- `LAUNCHER_TEST_SPIKE=BATCH[,BATCH...]`: while a named global batch trains, the final norm's output (and
  so the logits, the loss and the gradients) is scaled (spike.py).
- `LAUNCHER_TEST_HANG=STEP:RANK[:stop|sleep]`: at STEP, as it would enter forward_backward, that rank
  SIGSTOPs itself (stop, the default) or sleeps; first attempt only (watchdog.py).
- `LAUNCHER_TEST_KILL=STEP:REPLICA[:late]`: ft, that replica group's rank 0 SIGKILLs itself at STEP in its
  first life; `late`: its next life comes back only once the run has ended (replicas.py).
- `LAUNCHER_TEST_DISK_FULL=STEP[:RANK]`: that rank's checkpoint shard writes at STEP fail as a full disk
  (ckpt_write.py).

RANK defaults to 0. The plan is read from the environment on every ask (cheap; tests change it between
in-process runs). A value that does not parse is one `LauncherError` naming the variable and its syntax;
`train` checks the plan before any worker starts. No torch here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.errors import LauncherError

TEST_NAN_ENV = "LAUNCHER_TEST_NAN"
TEST_SPIKE_ENV = "LAUNCHER_TEST_SPIKE"
TEST_HANG_ENV = "LAUNCHER_TEST_HANG"
TEST_KILL_ENV = "LAUNCHER_TEST_KILL"
TEST_DISK_FULL_ENV = "LAUNCHER_TEST_DISK_FULL"


@dataclass(frozen=True)
class Nan:
    step: int
    rank: int = 0


@dataclass(frozen=True)
class Spike:
    batches: frozenset[int]


@dataclass(frozen=True)
class Hang:
    step: int
    rank: int
    mode: str = "stop"  # stop: SIGSTOP (its beat says forward_backward); sleep: a slow rank (its beat says data)


@dataclass(frozen=True)
class Kill:
    step: int
    replica: int
    late: bool = False


@dataclass(frozen=True)
class DiskFull:
    step: int
    rank: int = 0


@dataclass(frozen=True)
class FaultPlan:
    """Every fault a test asked for (None: not injected)."""

    nan: Nan | None = None
    spike: Spike | None = None
    hang: Hang | None = None
    kill: Kill | None = None
    disk_full: DiskFull | None = None

    def nan_step(self, rank: int) -> int | None:
        """The step whose model output turns NaN on `rank`."""
        return self.nan.step if self.nan is not None and self.nan.rank == rank else None

    def spike_batches(self) -> frozenset[int]:
        """The global batches whose logits are scaled while they train."""
        return self.spike.batches if self.spike is not None else frozenset()

    def hang_of(self, rank: int) -> Hang | None:
        return self.hang if self.hang is not None and self.hang.rank == rank else None

    def kill_of(self, replica: int | None) -> Kill | None:
        return self.kill if self.kill is not None and self.kill.replica == replica else None

    def disk_full_at(self, step: int, rank: int) -> bool:
        return self.disk_full is not None and (self.disk_full.step, self.disk_full.rank) == (step, rank)


INT = r"(\d+)"
SYNTAX = {  # variable → (its syntax in words, the pattern that reads it)
    TEST_NAN_ENV: ("STEP[:RANK], e.g. 5 or 3:1", re.compile(rf"{INT}(?::{INT})?")),
    TEST_SPIKE_ENV: ("BATCH[,BATCH...], e.g. 8 or 8,11", re.compile(rf"{INT}(?:,{INT})*")),
    TEST_HANG_ENV: ("STEP:RANK[:stop|sleep], e.g. 3:1:stop", re.compile(rf"{INT}:{INT}(?::(stop|sleep))?")),
    TEST_KILL_ENV: ("STEP:REPLICA[:late], e.g. 3:1", re.compile(rf"{INT}:{INT}(?::(late))?")),
    TEST_DISK_FULL_ENV: ("STEP[:RANK], e.g. 4 or 4:1", re.compile(rf"{INT}(?::{INT})?")),
}


def fields(env: Mapping[str, str], name: str) -> list[str] | None:
    """`name`'s value cut at `:` (None when unset or empty); a value that does not parse: LauncherError."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    words, pattern = SYNTAX[name]
    if pattern.fullmatch(raw) is None:
        raise LauncherError(f"{name}={raw}: a test fault plan reads {name}={words}; fix or unset {name}")
    return raw.split(":")


def fault_plan(env: Mapping[str, str] | None = None) -> FaultPlan:
    """The test fault plan in `env` (the process's environment by default)."""
    env = os.environ if env is None else env
    nan, hang, kill, disk = (
        fields(env, name) for name in (TEST_NAN_ENV, TEST_HANG_ENV, TEST_KILL_ENV, TEST_DISK_FULL_ENV)
    )
    spike = fields(env, TEST_SPIKE_ENV)
    return FaultPlan(
        nan=Nan(int(nan[0]), int(nan[1]) if len(nan) > 1 else 0) if nan else None,
        spike=Spike(frozenset(int(b) for b in spike[0].split(","))) if spike else None,
        hang=Hang(int(hang[0]), int(hang[1]), *hang[2:]) if hang else None,
        kill=Kill(int(kill[0]), int(kill[1]), kill[2:] == ["late"]) if kill else None,
        disk_full=DiskFull(int(disk[0]), int(disk[1]) if len(disk) > 1 else 0) if disk else None,
    )
