"""What `plan` prints, through the real CLI: at 120 columns (a terminal, or a pipe told COLUMNS) every line
fits whole, one line a layout; a log file, `plan.format=wide` and json keep every column; the header says
the batch as a number; no more layouts fit than were tried; and `plan` writes nothing where it runs.
Its speed is a benchmark, not a test: `python -m bench planner_speed`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.config.schema import CONF_DIR
from launcher.planner.columns import Columns
from launcher.planner.cost import StepTime
from launcher.planner.predict import bottleneck
from launcher.planner.report import HEADS, short_bottleneck
from tests.conftest import run_cli, run_shell

PLAN_70B = ("plan", "+model=70b", "hardware=h100_sxm", "nodes=16")
FIELDS = ("tp", "pp", "cp", "dp", "schedule", "recompute", "memory_gib", "step_time_s", "tokens_per_s", "mfu")


def plan(*args: str, cwd: Path, columns: int | None = 120) -> str:
    """`plan ARGS` in a pipe told `columns` (None: a log file's pipe, no COLUMNS)."""
    result = run_cli(*args, env={"COLUMNS": str(columns or "")}, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def assert_fits(out: str, width: int = 120) -> None:
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= width, out


@pytest.mark.slow
def test_the_default_table_fits_120_columns_one_line_a_layout(tmp_path: Path) -> None:
    out = plan(*PLAN_70B, cwd=tmp_path)
    assert_fits(out)
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+  tp ", line)]
    assert len(rows) == 10 and all(line.rstrip().endswith("%") for line in rows), out  # the bottleneck's share
    header = out.splitlines()[:2]
    assert "micro x microbatches x dp:" not in out and re.search(r"global batch [\d,]+ sequences", header[1]), header
    assert not list(tmp_path.iterdir())  # no outputs/ folder, no log, no .hydra


@pytest.mark.slow
def test_the_budget_and_the_comparison_fit_120_columns(tmp_path: Path) -> None:
    compare = "plan.compare=[h100_sxm,h200,b200,gb200_nvl72,tpu_v5p]"
    out = plan("plan", "+model=405b", "nodes=2048", "seq_len=8192", "batch.global=2048", "plan.tokens=15e12", compare,
               cwd=tmp_path)  # fmt: skip
    assert_fits(out)
    assert "global batch 2,048 sequences of 8,192 tokens" in out and "goodput" in out and "tpu_v5p" in out
    assert "replica ft  " in out and "dp 32 fsdp zero2" in out  # a table row whole, and the budget's lines


@pytest.mark.slow
def test_a_log_wide_and_json_keep_every_column(tmp_path: Path) -> None:
    for out in (plan(*PLAN_70B, "plan.top=3", cwd=tmp_path, columns=None),
                plan(*PLAN_70B, "plan.top=3", "plan.format=wide", cwd=tmp_path)):  # fmt: skip
        heads = next(line for line in out.splitlines() if line.startswith("#"))
        assert heads.split("  ")[0] == "#" and all(h in heads for h in HEADS), heads
        assert "compute (" in out and "…" not in out  # the bottleneck's whole sentence
    layouts = json.loads(plan(*PLAN_70B, "plan.top=3", "plan.format=json", cwd=tmp_path))
    assert len(layouts) == 3 and all(k in layouts[0] for k in FIELDS), layouts[0]


@pytest.mark.slow
def test_a_narrow_terminal_cuts_no_number_and_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """At 80 columns the words wrap and a table too wide runs past the edge, every cell whole (rich cut
    them to `2.…`); no line ends in spaces; `plan | head -1` stops as a pipeline's command does."""
    out = plan(*PLAN_70B, cwd=tmp_path, columns=80)
    assert "…" not in out and not [line for line in out.splitlines() if line != line.rstrip()], out
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+  tp ", line)]
    assert len(rows) == 10 and all(re.search(r"\d\.\d%$", line) for line in rows), out  # MFU last and whole
    words = [line for line in out.splitlines() if "  " not in line and not line.startswith("─")]
    assert all(len(line) <= 80 for line in words), out  # the lines of words wrapped
    piped = run_shell("COLUMNS=80 plan +model=8b nodes=1 | head -1", cwd=tmp_path)
    assert piped.stdout.startswith("8b on 8 x h100_sxm") and piped.stderr == "", piped.stderr


def test_a_table_is_plain_aligned_text() -> None:
    table = Columns(("name", "n", "note"), left=("name", "note"))
    table.add_row("a", "1", "")
    table.add_row("longer", "1,024", "x")
    assert table.lines() == ["name        n  note", "───────────────────", "a           1", "longer  1,024  x"]
    assert table.width == len("longer  1,024  note") and str(table).endswith("x\n")


@pytest.mark.slow
def test_no_more_layouts_fit_than_were_tried(tmp_path: Path) -> None:
    """FSDP layouts without pipelining are tried twice (ZeRO-3 and ZeRO-2): each counts as tried."""
    out = plan("plan", "+model=8b", "nodes=1", "plan.top=1", cwd=tmp_path)
    fit, tried = (int(n.replace(",", "")) for n in re.search(r"([\d,]+) of ([\d,]+) layouts fit", out).groups())
    assert 0 < fit <= tried, out
    assert "(1 node)" in out


@pytest.mark.slow
def test_config_dir_and_bad_input_through_the_compose_api(tmp_path: Path) -> None:
    """`plan` composes once without hydra.main: --config-dir still adds a folder, a bad key or folder is one line
    and exit 2, --help is Hydra's page; nothing is written where it runs."""
    mine = tmp_path / "conf" / "hardware"
    mine.mkdir(parents=True)
    profile = (Path(CONF_DIR) / "hardware" / "h100_sxm.yaml").read_text().replace("name: h100_sxm", "name: mygpu")
    (mine / "mygpu.yaml").write_text(profile)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = plan("plan", f"--config-dir={mine.parent}", "hardware=mygpu", "+model=8b", "nodes=1", "plan.top=1", cwd=cwd)
    assert "x mygpu (1 node)" in out
    for args, message in ((("stpes=1",), "error: unknown config key 'stpes': did you mean 'steps'?"),
                          (("--config-dir=nowhere", "tp=1"), "error: Additional config directory"),
                          (("nodes=x",), "error: nodes=x: expected a value of type Integer")):  # fmt: skip
        result = run_cli("plan", *args, cwd=cwd)
        assert result.returncode == 2 and result.stderr.startswith(message), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert run_cli("plan", "--help", cwd=cwd).stdout.startswith("plan: ranked parallel layouts")
    assert not list(cwd.iterdir())


def test_every_bottleneck_has_a_short_form() -> None:
    """Each of predict.bottleneck's sentences in a few words with its share (the 120-column table's column)."""
    zero = dict.fromkeys(("compute", "tp_comm", "cp_comm", "tp_host", "pp_p2p", "pp_bubble", "dp_exposed"), 0.0)
    parts = ("tp_comm", "cp_comm", "tp_host", "pp_bubble", "dp_exposed", "pp_p2p", "ep_comm", "loss", "tied_comm")
    levels = dict(tp_level="nvlink", cp_level="nvlink", dp_level="infiniband", pp_level="infiniband", ep_level="ib")
    for part in (*parts, "fp8_cast", None):
        t = StepTime(**{**zero, "compute": 1.0, "dp_total": 0.0, **levels, **({part: 3.0} if part else {})})
        text = bottleneck(t, 0.55)
        short = short_bottleneck(text)
        assert len(short) <= 20 and short.endswith("%") and short.split()[-1] in text, (text, short)
