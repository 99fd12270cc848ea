"""How long the watchdog lets a rank stay in a phase, how often ranks say where they are, and how long
the process group waits in a collective: the watchdog's clock (launcher/train/watchdog.py), which the
process setup (launcher/launch/spawn.py) reads too. No torch here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.config.schema import WatchdogConfig

PHASES = ("setup", "data", "forward_backward", "optimizer", "eval", "checkpoint", "done")  # in a step's order
SLOW_PHASES = {"setup", "checkpoint"}  # and the first step (allocations, compile): SLOW_FACTOR x the timeout
SLOW_FACTOR = 5.0
DEFAULT_COLLECTIVE_S = 600.0  # the process group's timeout by default (`collective_timeout_s`)
COLLECTIVE_MARGIN_S = 120.0  # and past the watchdog's allowance by this: its line and the stacks come first
FLOOR_S = {"cpu": 60.0, "cuda": 300.0}  # the shortest automatic timeout; other kinds: cuda's
STEP_FACTOR = 20.0  # automatic timeout: this many predicted step times (the prediction can be off)


def timeout_for(cfg: WatchdogConfig, kind: str, step_s: float) -> float:
    """Seconds a phase may last (0: off): `watchdog.timeout_s`, or STEP_FACTOR predicted steps, at least FLOOR_S."""
    if cfg.timeout_s is not None:
        return float(cfg.timeout_s)
    return max(FLOOR_S.get(kind, FLOOR_S["cuda"]), STEP_FACTOR * step_s)


def collective_timeout_s(nccl_timeout_s: int | None, watchdog_s: float) -> float:
    """The process group's timeout: `nccl_timeout_s`, or by default 600 s (NCCL's own) raised past the
    watchdog's longest allowance (SLOW_FACTOR x its timeout, the first step's: eight ranks compiling
    at once), so that a rank stuck in a collective is named by the watchdog, not cut off by NCCL."""
    if nccl_timeout_s is not None:
        return float(nccl_timeout_s)
    return max(DEFAULT_COLLECTIVE_S, SLOW_FACTOR * watchdog_s + COLLECTIVE_MARGIN_S)


def beat_period(timeout_s: float) -> float:
    """How often a rank writes its beat: a tenth of the timeout, within [0.25 s, 5 s]."""
    return min(max(timeout_s / 10, 0.25), 5.0)


def stale_after(timeout_s: float) -> float:
    """A beat older than this: its process was not scheduled for three periods (or more)."""
    return max(3 * beat_period(timeout_s), 2.0)
