"""`plan`'s charts (launcher/planner/charts.py): `plan.compare` draws its bars where `plan.chart` says and
prints the line naming the file, `plan.calibrate` draws its fit beside the calibrated profile; without
matplotlib a note with the install hint, a failed drawing one warning line, never a failed command; JSON stays
one document on stdout; and plain `plan`, and a comparison not asked for a chart, write nothing."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from bench.published_runs import make_cfg
from launcher import planner
from launcher.errors import LauncherError
from launcher.planner.calibrate import calibrate
from launcher.planner.charts import chart_path, compare_chart
from tests.conftest import run_cli
from tests.unit.test_planner_fit import configs, synthetic, write_summaries  # noqa: F401 (configs: a fixture)

PNG = b"\x89PNG\r\n\x1a\n"
HINT = "(pip install 'launcher[plot]')"


def plan_cfg(model: str = "8b", **plan: object) -> object:
    return make_cfg(model, "h100_sxm", tp="auto", seq_len=2048, batch={"micro": 1, "global": 64}, plan=plan)


def compared(**plan: object) -> object:
    return plan_cfg(tokens=1e12, compare=["h100_sxm", "b200"], top=1, **plan)


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, as `plan` finds one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "120")
    return tmp_path


def test_compare_draws_its_bars_where_plan_chart_says(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    planner.run_plan(compared(chart="charts/plan_compare.png"))
    out = capsys.readouterr().out
    assert (here / "charts" / "plan_compare.png").read_bytes().startswith(PNG)
    assert out.splitlines()[-1] == "plan.compare chart: charts/plan_compare.png", out[-500:]  # under the table
    assert "plan.compare: 1T tokens of 8b" in out


def test_plain_plan_and_a_comparison_without_plan_chart_write_nothing(here: Path, capsys) -> None:
    planner.run_plan(plan_cfg(top=1))
    planner.run_plan(compared())
    assert "chart" not in capsys.readouterr().out and not list(here.iterdir())


def test_without_matplotlib_a_note_and_no_chart(here: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("launcher.charts.installed", lambda module: module != "matplotlib")
    planner.run_plan(compared(chart="plan_compare.png"))
    assert capsys.readouterr().out.splitlines()[-1] == f"note: no plan.compare chart without matplotlib {HINT}"
    assert not list(here.iterdir())


def test_a_chart_that_cannot_be_written_is_one_warning(here: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    (here / "taken").write_text("a file, not a folder")
    planner.run_plan(compared(chart="taken/plan_compare.png"))  # returns: the tables are the command's answer
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("warning: no plan.compare chart (") and "\n" not in line, line


def test_json_stays_one_document_the_line_goes_to_stderr(here: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    planner.run_plan(compared(chart="plan_compare.png", format="json"))
    captured = capsys.readouterr()
    assert [row["hardware"] for row in json.loads(captured.out)["compare"]] == ["h100_sxm", "b200"]
    assert captured.err.strip() == "plan.compare chart: plan_compare.png"
    assert (here / "plan_compare.png").read_bytes().startswith(PNG)


def test_a_profile_no_layout_fits_is_a_word_in_place_of_a_bar(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    cfg = make_cfg("70b", "h100_sxm", tp="auto", pp="auto", plan={"tokens": 1e12, "compare": ["h100_sxm", "b200"]})
    rows = planner.compare(cfg, 8)
    assert rows[0].budget is None and rows[1].budget is not None
    assert compare_chart(rows, "70b", tmp_path / "c.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize(
    "chart, compare, calibrate, line",
    [
        ("plan_compare.txt", True, False, "plan.chart=plan_compare.txt: name a .png file (or .svg, .pdf)"),
        ("plan_compare.png", False, False, "plan.chart draws plan.compare's bars or plan.calibrate's fit: give"),
    ],
)
def test_bad_plan_chart_is_one_line(chart: str, compare: bool, calibrate: bool, line: str) -> None:
    with pytest.raises(LauncherError) as err:
        chart_path(chart, compare, calibrate)
    assert line in str(err.value) and "\n" not in str(err.value)
    assert chart_path(None, False, False) is None and chart_path("a/b.svg", True, False) == Path("a/b.svg")


def test_calibrate_draws_its_fit_beside_the_profile(tmp_path: Path, configs, monkeypatch, capsys) -> None:  # noqa: F811
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    folder = write_summaries(tmp_path, configs, synthetic(configs, {"matmul_efficiency": 0.6}))
    out = io.StringIO()
    calibrate(str(folder), configs[0].hardware, "cal", "", "table", out)
    assert out.getvalue().splitlines()[-1] == "calibration chart: cal/cpu_calibration.png"
    assert (tmp_path / "cal" / "cpu_calibration.png").read_bytes().startswith(PNG)
    out = io.StringIO()  # JSON without matplotlib: the document on out, the note on stderr, no chart at plan.chart
    monkeypatch.setattr("launcher.charts.installed", lambda module: False)
    calibrate(str(folder), configs[0].hardware, "cal", "", "json", out, chart=Path("fit.svg"))
    assert json.loads(out.getvalue())["hardware"] == "cpu_calibrated"
    assert capsys.readouterr().err.strip() == f"note: no calibration chart without matplotlib {HINT}"
    assert not (tmp_path / "fit.svg").exists()


@pytest.mark.slow
def test_plan_chart_through_the_cli(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    args = ("plan", "+model=8b", "nodes=1", "plan.top=1", "plan.tokens=1e12", "plan.compare=[h100_sxm,b200]")
    result = run_cli(*args, "plan.chart=plan_compare.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "plan.compare chart: plan_compare.png" in result.stdout
    assert (tmp_path / "plan_compare.png").read_bytes().startswith(PNG)
    bad = run_cli("plan", "+model=8b", "nodes=1", "plan.chart=plan.png", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: plan.chart draws plan.compare's bars"), bad.stderr
