"""How a command ends when it cannot finish: exit codes, and exceptions that carry theirs.

An error is raised where it arises, as an object with its message and exit code, and travels up
unchanged: the CLI prints it as one line and exits with its code (launcher/launch/cli.py); a point of a
sweep records it (launcher/launch/sweep.py). Nothing parses error text.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

FAILED = 1  # a worker or this process failed (Python's own code for an uncaught exception)
BAD_INPUT = 2  # refused before any worker started
NON_FINITE = 3  # a NaN/inf loss or gradient norm stopped training; the last good checkpoint is kept
HUNG = 4  # a rank stopped making progress (launcher/train/watchdog.py): its stacks are in RUN_DIR/watchdog
PREEMPTED = 75  # EX_TEMPFAIL, "try again later": every rank saved at the same step; a rerun resumes
INTERRUPTED = 128 + signal.SIGINT  # the shell's code for a command stopped by Ctrl-C (nothing saved)


class LauncherError(Exception):
    """Bad input. Its message is one line naming the key and the fix; the CLI prints it, exit 2."""

    exit_code = BAD_INPUT


class WorkerFailed(LauncherError):
    """A worker died; the message names its rank and error."""

    exit_code = FAILED


class OutOfMemory(LauncherError):
    """A rank could not allocate its part of the model; the message names the rank, the bytes it tried
    to allocate and the planner's estimate."""

    exit_code = FAILED


class NonFinite(LauncherError):
    """A step's loss or gradient norm is NaN or infinite: the run stops before that update; the message
    names the step, the rank and the last good checkpoint."""

    exit_code = NON_FINITE


class CheckpointFailed(LauncherError):
    """A checkpoint could not be written (the final or a preemption's save, or any with
    checkpoint.on_error=stop): the message names the step, the cause, the folder and the checkpoint kept."""

    exit_code = FAILED


class Hung(LauncherError):
    """A rank made no progress for `watchdog.timeout_s`: the message names it, its phase and step,
    the ranks waiting for it, and where the stacks are."""

    exit_code = HUNG


# what a worker's exception becomes in the launcher (by its class name: the elastic agent's record of a
# failed worker carries the name and message, not the object): the same class, so the same exit code
CROSSING = {cls.__name__: cls for cls in (LauncherError, NonFinite, CheckpointFailed)}


@contextmanager
def usage_errors_raised() -> Iterator[None]:
    """argparse's usage errors (`train --foo`, overrides on both sides of a flag, `doctor --x`) as one
    LauncherError line instead of its usage block; hydra.main's parser and the commands' own alike."""

    def error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
        raise LauncherError(f"{parser.prog}: {message} (flags first, then KEY=VALUE overrides: {parser.prog} --help)")

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


@contextmanager
def broken_pipe_quiet() -> Iterator[None]:
    """`plan | head`: the reader closed the pipe; stop as a command in a pipeline does, without a traceback
    (stdout onto /dev/null first: Python's flush at exit would raise again)."""
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(FAILED)
