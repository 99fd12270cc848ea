"""docs/config.md's key reference is the schema's (scripts/config_doc.py): every key, its default and its comment,
and `--check` fails the moment the schema and the page part."""

from __future__ import annotations

import runpy
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launcher.config.ranges import leaves, ranged
from launcher.config.schema import TrainConfig
from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "config_doc.py"
PAGE = ROOT / "docs" / "config.md"


def generator() -> dict:
    return runpy.run_path(str(SCRIPT), run_name="config_doc")


def expanded(cfg: TrainConfig) -> list[tuple[str, object]]:
    """Every leaf key and value, a dict section's (init) by its keys."""
    found = []
    for key, value, _ in leaves(cfg):
        found += [(f"{key}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]
    return found


def test_config_page_is_the_schemas() -> None:
    """The committed page is what the generator writes now: run `python scripts/config_doc.py` after editing the
    schema."""
    assert PAGE.read_text() == generator()["page"](), "docs/config.md is stale: run python scripts/config_doc.py"


def test_every_schema_key_is_in_the_page_with_its_default() -> None:
    page, spell = PAGE.read_text().split(generator()["MARKER"])[1], generator()["spell"]
    assert len(expanded(TrainConfig())) > 150
    for key, value in expanded(TrainConfig()):
        row = next((line for line in page.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, key
        assert f"| `{spell(value)}` |" in row, (key, row)
    # a comment above a key and one after it both reach its row
    assert "seconds a rank may stay in one phase of a step" in page  # watchdog.timeout_s, above
    assert "| `optim.grad_clip` | `float` | `1.0` | >= 0 | 0 disables clipping |" in page  # after


@dataclass
class Inner:
    """An inner section."""

    depth: int = ranged(3, ge=1)  # how deep


@dataclass
class Outer:
    # the width, said above
    width: float | None = ranged(None, gt=0)
    inner: Inner = field(default_factory=Inner)
    many: list[Inner] = field(default_factory=list)


def test_a_new_key_shows_with_its_comment_type_default_and_range() -> None:
    """The generator reads a dataclass it has never seen: nested sections, a list of sections, comments."""
    found = {prefix: (words, rows) for prefix, words, rows in generator()["sections"](Outer, "x.")}
    assert found["x"][1][0] == ("x.width", "float | None", "null", "a value > 0", "the width, said above")
    assert found["x.inner"] == ("An inner section.", [("x.inner.depth", "int", "3", "an integer >= 1", "how deep")])
    assert found["x.many[]"][1][0][0] == "x.many[].depth"


@pytest.mark.slow
def test_check_flag_fails_on_a_stale_page(tmp_path: Path) -> None:
    """Through the script as CI or a user runs it: 0 on the committed page, 1 (naming the fix) on one a key
    went missing from, and the rewrite mends it."""

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path)

    ok = run("--check")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    stale = tmp_path / "config.md"
    stale.write_text(
        "\n".join(line for line in PAGE.read_text().splitlines() if not line.startswith("| `optim.grad_clip` |"))
    )
    bad = run("--check", f"--page={stale}")
    assert bad.returncode == 1 and "run python scripts/config_doc.py" in bad.stdout, bad.stdout + bad.stderr
    mended = run(f"--page={stale}")
    assert mended.returncode == 0 and stale.read_text() == PAGE.read_text()
