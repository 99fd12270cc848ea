"""The end of a run for people: the summary table (measured beside predicted, in units) and loss.png."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from launcher.metrics import charts
from launcher.metrics.console import ConsoleView
from launcher.metrics.summary_view import count, duration, size, summary_view

LAYOUT = {"tp": 2, "pp": 1, "dp_replicate": 1, "dp_shard": 2, "micro": 8, "microbatches": 1, "schedule": "1f1b"}
LAYOUT |= {"virtual_stages": 1, "recompute": "none", "sequence_parallel": False, "recompute_layers": 0}
LAYOUT |= {"reshard": "auto", "cp": 1, "ep": 1}


def run_summary(prediction: bool = True) -> dict[str, Any]:
    """What `train tp=2 dp=2 +model=tiny steps=20` wrote to summary.json (the config cut to what is read)."""
    summary = {
        "final_loss": 3.7992300987243652,
        "val_loss": 3.5565786361694336,
        "steps": 20,
        "median_tokens_per_s": 24317.85478524564,
        "median_tflops_per_device": 0.006349878241523341,
        "median_mfu": 0.07005834756899704,
        "peak_mem_gib": 0.4092674255371094,
        "peak_mem_gib_per_rank": [0.4092674255371094, 0.31501007080078125, 0.3156547546386719, 0.31427001953125],
        "flops_per_token": 1044480.0,
        "peak_flops_per_device": 90636997044.06612,
        "threads_per_worker": 1,
        "skipped_steps": 0,
        "checkpoint_save_s": {"total": 0.116, "median": 0.116, "count": 1},
        "checkpoint_bytes_per_rank": [376788, 376788, 376788, 376788],
        "world_size": 4,
        "layout": LAYOUT,
        "model": "tiny",
        "params": 125248,
        "precision": "fp32",
        "compile": False,
        "optimizer_impl": "fused",
        "wall_time_s": 6.47868162299892,
        "peak_mem_measure": "process peak resident set less mapped files",
        "cpu_allocator": "fast",
        "config": {"seq_len": 256, "model": {"name": "tiny"}},
    }
    if prediction:
        summary["prediction"] = {
            "hardware": "cpu",
            "tokens_per_step": 4096,
            "memory_gib": 0.364,
            "memory": {"activations": 0.011, "overhead": 0.35, "total": 0.364},
            "checkpoint_bytes_per_rank": 376704,
            "fits": True,
            "step_time_s": 0.20756032936367308,
            "time_s": {"compute": 0.044, "tp_comm": 0.114, "total": 0.2076},
            "tokens_per_s": 19734.02148935343,
            "mfu": 0.11370517248700758,
            "bottleneck": "TP communication over shared_memory (55% of step)",
            "dtype": "fp32",
            "mfu_fp8_peak": None,
        }
    return summary


def rendered(summary: dict[str, Any], width: int = 200) -> str:
    """The view as a console `width` wide prints it (wide: the table's own width shows)."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(summary_view(summary))
    return out.getvalue()


def row(text: str, label: str) -> list[str]:
    """The cells of the table row labelled `label`."""
    line = next(line for line in text.splitlines() if line.startswith(f"│ {label} "))
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_the_summary_shows_measured_beside_predicted_in_units() -> None:
    text = rendered(run_summary())
    assert row(text, "tokens/s") == ["tokens/s", "24,318", "19,734", "1.23×"]
    assert row(text, "MFU") == ["MFU", "7.0%", "11.4%", "0.62×"]
    assert row(text, "step time") == ["step time", "168 ms", "208 ms", "0.81×"]  # 4,096 tokens a step
    assert row(text, "peak memory GiB/rank") == ["peak memory GiB/rank", "0.31 / 0.41 (max on rank 0)", "0.36", "1.12×"]
    assert row(text, "checkpoint size/rank")[1:3] == ["368.0 KiB", "367.9 KiB"]
    assert "predicted" in text and "bottleneck TP communication over shared_memory (55% of step)" in text
    for words in ("summary · tiny · tp 2 · dp 2 fsdp · 20 steps", "3.7992", "3.5566", "125.2 k", "6.5 s"):
        assert words in text, words
    assert "skipped" not in text  # none skipped: no row


def test_the_summary_dumps_no_key_and_no_list() -> None:
    summary = run_summary()
    text = rendered(summary)
    assert "[0." not in text and "[376788" not in text and "{" not in text and "None" not in text
    keys = [key for key in (*summary, *summary["prediction"]) if "_" in key]
    assert [key for key in keys if key in text] == []
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 120
    narrow = rendered(summary, width=80)  # a log without COLUMNS: still every figure, in full
    assert "0.31 / 0.41 (max on rank 0)" in narrow and "1.23×" in narrow


def test_without_a_prediction_there_is_no_predicted_column() -> None:
    text = rendered(run_summary(prediction=False))
    assert row(text, "tokens/s") == ["tokens/s", "24,318"]
    assert "predicted" not in text and "ratio" not in text and "bottleneck" not in text


def test_the_rest_of_a_run_in_words() -> None:
    summary = run_summary() | {"skipped_steps": 2, "ft_short_steps": [3, 4], "ft_tokens_missed": 8192}
    summary |= {"tokens.web": 61440, "tokens.code": 20480, "share.web": 0.75, "share.code": 0.25}
    summary |= {"compiled": {"units": 4, "graphs": 4, "graph_breaks": 1, "break_reasons": {"x": 1}}}
    summary |= {"precision": "fsdp_bf16", "moe_load_imbalance": 1.234, "params": 1.24e9, "wall_time_s": 125}
    text = rendered(summary)
    for words in (
        "skipped steps         2",
        "source web            75.0% of tokens (61.4 k)",
        "4 modules into 4 graphs, 1 graph breaks",
        "bf16 (FSDP mixed precision)",
        "1.23 (max / mean tokens per expert)",
        "2 short of a replica group, 8,192 tokens not trained on",
        "1.24 B",
        "2 min 05 s",
    ):
        assert words in text, words


def test_units() -> None:
    assert [count(n) for n in (950, 125248, 12.5e6, 1.24e9)] == ["950", "125.2 k", "12.5 M", "1.24 B"]
    assert [size(n) for n in (512, 376788, 1.3 * 2**30)] == ["512 B", "368.0 KiB", "1.3 GiB"]
    assert [duration(s) for s in (0.168, 8.71, 125, 3725)] == ["168 ms", "8.7 s", "2 min 05 s", "1 h 02 min"]


def test_the_console_prints_the_table_at_the_end(capsys: pytest.CaptureFixture[str]) -> None:
    view = ConsoleView("plain", 20, "header")
    view.close(run_summary())
    out = capsys.readouterr().out
    assert "24,318" in out and "19,734" in out and "median_tokens_per_s" not in out


def test_a_loss_curve_from_metrics_jsonl(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "loss.web": 5.1 - 0.1 * s} for s in range(1, 6)]
    rows[-1]["val_loss"] = 4.6
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = charts.run_loss_curve(tmp_path, "tiny")
    assert line == f"loss curve: {tmp_path / 'loss.png'}"
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_loss_curve_never_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')  # cut short by a crash
    line = charts.run_loss_curve(tmp_path, "tiny")
    assert line is not None and line.startswith("warning: no loss curve (JSONDecodeError")
    assert not (tmp_path / "loss.png").exists()
    monkeypatch.setattr("launcher.charts.installed", lambda module: False)  # every chart asks there
    assert (
        charts.run_loss_curve(tmp_path, "tiny")
        == "note: no loss curve without matplotlib (pip install 'launcher[plot]')"
    )


def test_an_fp8_run_reads_as_fp8_with_its_layer_counts() -> None:
    fp8 = {"recipe": "tensorwise", "emulate": True, "converted": {"w1": 8, "wo": 6}, "high_precision": [{"count": 1}]}
    text = rendered(run_summary() | {"precision": "fp8 (tensorwise, emulated) + bf16 autocast", "fp8": fp8})
    assert "fp8 (tensorwise, emulated) + bf16 autocast: 14 layers in fp8, 1 kept high precision" in text


def test_an_mfu_above_the_peak_says_the_cached_peak_is_stale() -> None:
    text = rendered(run_summary() | {"median_mfu": 1.4, "cpu_allocator": "fast"})
    assert "MFU above 100%" in text and "`doctor` re-measures it" in text
    assert "MFU above 100%" not in rendered(run_summary() | {"cpu_allocator": "fast"})
