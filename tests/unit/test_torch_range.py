"""pyproject.toml's torch range is what `make test-compat` proves: its ends are the two versions
scripts/test_compat.sh tests, the pinned torch of `make test` lies inside, and the README says the same."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def minor(version: str) -> tuple[int, int]:
    major, minor_, *_ = version.split(".")
    return int(major), int(minor_)


def versions_under_test() -> list[str]:
    (line,) = re.findall(r"^VERSIONS=\((.*)\)$", (ROOT / "scripts/test_compat.sh").read_text(), re.M)
    return line.split()


def torch_requirement() -> str:
    (torch,) = re.findall(r'^\s*"(torch\b[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    return torch


def test_the_range_is_the_versions_under_test() -> None:
    oldest, newest = (minor(v) for v in versions_under_test())
    assert torch_requirement() == f"torch>={oldest[0]}.{oldest[1]},<{newest[0]}.{newest[1] + 1}"


def test_the_pinned_torch_lies_inside_and_the_readme_states_the_range() -> None:
    (pinned,) = re.findall(r"pip install -q torch==(\S+)", (ROOT / "Makefile").read_text())
    oldest, newest = (minor(v) for v in versions_under_test())
    assert oldest <= minor(pinned) <= newest
    spec = torch_requirement().removeprefix("torch")
    assert f"`torch{spec}`" in (ROOT / "README.md").read_text()
