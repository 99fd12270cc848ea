"""`plan plan.calibrate=DIR hardware=NAME` (several: `plan.calibrate=[DIR,DIR]`): fit the profile NAME to the
runs under the directories (launcher/planner/calibrate_fit.py), print each run's step time measured beside
predicted before and after (fitted and held-out runs apart), and write the calibrated profile where
`--config-dir` finds it: `plan.calibrate_out`/hardware/NAME_calibrated.yaml, every number resolved (a
CPU's calibrated ones too).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from launcher.config.hardware import HardwareConfig, LinkConfig
from launcher.config.validate import calibrate_value, check_calibrate
from launcher.errors import LauncherError
from launcher.files import make_dir, write_atomic
from launcher.hardware.profile import LINK_EFFICIENCY, needs_calibration, resolved_hardware
from launcher.planner.calibrate_fit import HOST, Knob, Observation, fit, held_out, knobs, read_runs, seen, step_times
from launcher.planner.charts import calibration_line, say


def calibrate(
    value: Any,
    hw: HardwareConfig,
    out_dir: str,
    cache_dir: str,
    fmt: str,
    out: TextIO | None = None,
    chart: Path | None = None,
) -> Path:
    """Fit `hw` to the runs under plan.calibrate's directories (`value`: one, or a list), report, write
    the calibrated profile and the chart of the fit (`chart`, else beside the profile); return its path."""
    dirs = check_calibrate(value)
    make_dir(Path(out_dir) / "hardware", "plan.calibrate_out")  # before the fit: an unwritable one costs nothing
    runs, skipped = read_runs(dirs, hw)
    if not runs:
        raise LauncherError(f"plan.calibrate={calibrate_value(dirs)}: no usable run ({skipped[0]}): give finished runs")
    threads = sorted({r.threads for r in runs})
    if needs_calibration(hw) and len(threads) > 1:
        raise LauncherError(
            f"plan.calibrate: the runs used {' and '.join(map(str, threads))} threads per worker, and the "
            f"'{hw.name}' profile's peak is measured per thread count: calibrate runs of one count (threads=N)"
        )
    out_labels = held_out(runs)
    fitted = [r for r in runs if r.label not in out_labels]
    found = knobs(hw, max(runs, key=lambda r: r.problem.world).problem.machine)  # one process measures no TP host
    kept = [k for k, moved in zip(found, seen(fitted, found)) if moved]
    mults = fit(fitted, kept)
    rows = result_rows(runs, out_labels, step_times(runs, kept, [1.0] * len(kept)), step_times(runs, kept, mults))
    resolved = resolved_hardware(hw, threads[0], cache_dir)
    profile = calibrated(hw, resolved, kept, mults)
    path = Path(out_dir) / "hardware" / f"{profile.name}.yaml"
    result = {
        "profile": str(path),
        "hardware": profile.name,
        "use": f"--config-dir={Path(out_dir).resolve()} hardware={profile.name}",
        "constants": constants(calibrated(hw, resolved, kept, [1.0] * len(kept)), profile, kept, mults),
        "not_seen": [k.key for k in found if k not in kept],
        "error": errors(rows),
        "runs": rows,
        "skipped": skipped,
    }
    held = result["error"]["held_out"]
    if held and held["after"] > held["before"]:
        result["note"] = (
            "the held-out runs are predicted worse after the fit: the fitted runs are too few or too noisy "
            f"for {len(kept)} constants; add runs of more layouts (longer, on a quiet machine), or keep the profile"
        )
    write_atomic(path, header(result, dirs) + yaml.safe_dump(dataclasses.asdict(profile), sort_keys=False))
    out = out or sys.stdout
    if fmt == "json":
        out.write(json.dumps(result, indent=1) + "\n")
    else:
        report(result, out)
    chart = chart or Path(out_dir) / f"{hw.name.removesuffix('_calibrated')}_calibration.png"
    title = f"{hw.name} fitted to {len(rows)} runs\n" + error_line(result).replace(": ", ":\n", 1)
    say(calibration_line(rows, title, chart), sys.stderr if fmt == "json" else out)  # stdout: one JSON document
    return path


def sig(x: float) -> float:
    return float(f"{x:.4g}")


def calibrated_link(given: LinkConfig, link: LinkConfig, m: float) -> LinkConfig:
    """`link` (resolved) m times as fast: the bandwidths its collectives reach times `m`, written as
    reached (efficiency 1: a datasheet number was read at LINK_EFFICIENCY, a measured one as it is),
    its latency over `m`."""
    share = m * (link.efficiency or (1.0 if given.bandwidth_gbs is None else LINK_EFFICIENCY))

    def times(x: float | None) -> float | None:
        return None if x is None else sig(x * share)

    return dataclasses.replace(
        link,
        bandwidth_gbs=times(link.bandwidth_gbs),
        all_gather_gbs=times(link.all_gather_gbs),
        reduce_scatter_gbs=times(link.reduce_scatter_gbs),
        all_to_all_gbs=times(link.all_to_all_gbs),
        by_size=[[row[0], *(sig(r * share) for r in row[1:])] for row in link.by_size] if link.by_size else None,
        latency_us=None if link.latency_us is None else sig(link.latency_us / m),
        efficiency=1.0,
    )


def calibrated(
    hw: HardwareConfig, resolved: HardwareConfig, kept: Sequence[Knob], mults: Sequence[float]
) -> HardwareConfig:
    """The profile `resolved` with each fitted number multiplied, named NAME_calibrated."""
    m = {k.key: v for k, v in zip(kept, mults)}
    numbers = {key: sig(getattr(resolved, key) * m.get(key, 1.0)) for key in ("matmul_efficiency", *HOST.values())}
    numbers["matmul_efficiency"] = min(1.0, numbers["matmul_efficiency"])
    links = [calibrated_link(g, r, m.get(f"links.{r.name}", 1.0)) for g, r in zip(hw.links, resolved.links)]
    name = f"{hw.name.removesuffix('_calibrated')}_calibrated"
    return dataclasses.replace(resolved, name=name, links=links, **numbers)


def constants(
    before: HardwareConfig, after: HardwareConfig, kept: Sequence[Knob], mults: Sequence[float]
) -> dict[str, dict[str, float]]:
    """Each fitted constant: the profile's number, the calibrated one, the multiplier (link bandwidths as
    the collectives reach them, in both)."""
    found = {}
    for knob, m in zip(kept, mults):
        if knob.key.startswith("links."):
            i = [link.name for link in before.links].index(knob.attr)
            was, now = before.links[i].bandwidth_gbs, after.links[i].bandwidth_gbs
            found[f"{knob.key}.bandwidth_gbs"] = {"before": was, "after": now, "multiplier": m}
        else:
            found[knob.key] = {"before": getattr(before, knob.key), "after": getattr(after, knob.key), "multiplier": m}
    return found


def result_rows(
    runs: Sequence[Observation], out_labels: set[str], before: Sequence[float], after: Sequence[float]
) -> list[dict[str, Any]]:
    return [
        {
            "run": r.run,
            "layout": r.label,
            "measured_s": r.measured_s,
            "before_s": b,
            "after_s": a,
            "error_before": b / r.measured_s - 1,
            "error_after": a / r.measured_s - 1,
            "held_out": r.label in out_labels,
        }
        for r, b, a in zip(runs, before, after)
    ]


def errors(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """Mean |predicted / measured - 1| of the fitted and the held-out runs, before and after."""

    def mean(part: list[dict[str, Any]], key: str) -> float:
        return statistics.mean(abs(row[key]) for row in part)

    parts = {"fitted": [r for r in rows if not r["held_out"]], "held_out": [r for r in rows if r["held_out"]]}
    return {
        name: {"before": mean(part, "error_before"), "after": mean(part, "error_after")} if part else None
        for name, part in parts.items()
    }


def error_line(result: dict[str, Any]) -> str:
    parts = [
        f"{name.replace('_', ' ')} {e['before']:.1%} -> {e['after']:.1%}" if e else f"{name.replace('_', ' ')}: none"
        for name, e in result["error"].items()
    ]
    return "step time error, mean |predicted / measured - 1|: " + ", ".join(parts)


def header(result: dict[str, Any], dirs: Sequence[str]) -> str:
    rows = result["runs"]
    return (
        f"# `{result['hardware']}`: fitted by `plan plan.calibrate={calibrate_value(dirs)}`"
        " (launcher/planner/calibrate_fit.py)\n"
        f"# to {len(rows)} runs, {sum(r['held_out'] for r in rows)} of them held out; {error_line(result)}.\n"
        "# Link bandwidths are what the runs' collectives reached (efficiency 1). Use it:\n"
        f"#   plan {result['use']} ...\n"
    )


def report(result: dict[str, Any], out: TextIO) -> None:
    rows = result["runs"]
    width = max(len(r["run"]) for r in rows)
    lay = max(len(r["layout"]) for r in rows)
    out.write(f"{'run':<{width}}  {'layout':<{lay}}  measured s  before s  after s  err before  err after  set\n")
    for r in rows:
        out.write(
            f"{r['run']:<{width}}  {r['layout']:<{lay}}  {r['measured_s']:>10.4g}  {r['before_s']:>8.4g}  "
            f"{r['after_s']:>7.4g}  {r['error_before']:>+10.1%}  {r['error_after']:>+9.1%}  "
            f"{'held out' if r['held_out'] else 'fit'}\n"
        )
    out.write(error_line(result) + "\n")
    for key, c in result["constants"].items():
        out.write(f"  {key}: {c['before']:.4g} -> {c['after']:.4g} (x{c['multiplier']:.3g})\n")
    if result["not_seen"]:
        out.write(f"  kept (no fitted run depends on them): {', '.join(result['not_seen'])}\n")
    for line in result["skipped"]:
        out.write(f"  skipped {line}\n")
    if "note" in result:
        out.write(f"note: {result['note']}\n")
    out.write(f"wrote {result['profile']}; plan or train with it: plan {result['use']} ...\n")
