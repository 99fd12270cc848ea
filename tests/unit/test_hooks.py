"""The step's hooks (launcher/train/hooks.py): a hook added to the list `setup.hooks_for` builds is called by the
real loop at each moment, in the step's order, keeps its state in every checkpoint and puts its entries into
summary.json; a refusal at `allow_update` stops the asking there."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.train import setup
from launcher.train.hooks import Hook, Hooks, Step
from launcher.train.loop import train
from launcher.train.untrusted import read_extras
from tests.conftest import run_for, tiny_config


class Recorder(Hook):
    """Every moment it is called at, with the step's number."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def before_step(self, s: Step) -> None:
        self.seen.append(("before_step", s.number))

    @contextlib.contextmanager
    def during_forward(self, s: Step) -> Iterator[None]:
        self.seen.append(("forward", s.number))
        yield
        self.seen.append(("backward done", s.number))

    def after_backward(self, s: Step) -> None:
        assert s.loss == s.loss, "the loss is this step's"
        self.seen.append(("after_backward", s.number))

    def allow_update(self, s: Step) -> bool:
        self.seen.append(("allow_update", s.number))
        return True

    def after_update(self, s: Step) -> None:
        assert s.updated and s.counted
        self.seen.append(("after_update", s.number))

    def after_step(self, s: Step) -> None:
        s.row["recorded"] = len(self.seen)
        self.seen.append(("after_step", s.number))

    def before_save(self, step: int) -> None:
        self.seen.append(("before_save", step))

    def at_end(self, stopped: bool) -> None:
        self.seen.append(("at_end", int(stopped)))

    def extras(self) -> dict[str, Any]:
        return {"recorder": len(self.seen)}

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"recorded_rows": [row["recorded"] for row in rows]}


STEP = ["before_step", "forward", "backward done", "after_backward", "allow_update", "after_update", "after_step"]


@pytest.mark.slow
def test_a_hook_joins_the_real_loop_at_its_moments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder, built = Recorder(), setup.hooks_for
    monkeypatch.setattr(setup, "hooks_for", lambda w, watchdog: Hooks([*built(w, watchdog), recorder]))
    run_dir = tmp_path / "r"
    summary = train(run_for(tiny_config(tmp_path, "steps=3", "checkpoint.every=2")), run_dir)
    steps = [(moment, step) for step in (1, 2, 3) for moment in STEP]
    saves = [("before_save", 2), ("before_save", 3), ("before_save", 3)]  # the end waits for the last save
    expected = steps[:14] + saves[:1] + steps[14:] + saves[1:] + [("at_end", 0)]
    assert recorder.seen == expected
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["recorded"] for row in rows] == summary["recorded_rows"] == [6, 13, 21]
    assert read_extras(run_dir / "checkpoints" / "step_00000002")["recorder"] == 15


def test_a_refusal_ends_the_asking() -> None:
    asked: list[str] = []

    class Ask(Hook):
        def __init__(self, name: str, answer: bool) -> None:
            self.name, self.answer = name, answer

        def allow_update(self, s: Step) -> bool:
            asked.append(self.name)
            return self.answer

    s = Step(1, 3)
    assert not Hooks([Ask("ft", True), Ask("guard", False), Ask("spike", True)]).allow_update(s)
    assert asked == ["ft", "guard"] and s.counted
    assert Hooks().allow_update(s) and not Hooks().stop_requested and not Hooks().ended
