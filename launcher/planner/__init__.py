"""The layout planner: predict memory, step time and MFU of every layout, pick the best, refuse what
cannot fit. Pure Python: nothing here imports torch unless a profile needs calibrating (cpu).

- `resolve(cfg, env_world_size)`: the run's one `Layout`, the prediction for it and the
  `BuildOptions` (launcher/config/options.py). The CLI's only call into the planner: `train` and its dry
  run use it once, and the runtime reads these, never the config.
- `run_plan(cfg)`: the `plan` command (ranked table fitting the terminal, every column with plan.format=wide,
  or JSON with plan.format=json).
- `plan(cfg, world)`: every valid layout of `world` devices, ranked (also the layout sweeper's); with
  `precision`, dtype=auto on a profile with FP8 units also ranks fp8 (`plan` only: `train dtype=auto`
  stays bf16, numerics never change unasked).
- `compare(cfg, world)`: `plan.compare`, each profile's best layout and its token budget (budget.py).

`plan` and `train` accept the same configs: both run `validate.validate`, and every layout either
considers passes the rules of launcher/layout/ (`layout.violations`).

Modules by role (the machine a layout runs on is launcher/hardware/: profile.py, machine.py):
- the seam: request (config -> search space), resolve here;
- the prediction's terms: memory, compute with efficiency, eager, fp8 and moe, comm (collectives on
  link levels), timeline (a schedule's in-flight microbatches), cost (step time, the bottleneck);
- the search: search (enumerate + rank), memo (per-stage terms memoised on the layout fields they read);
- economics: budget (what a token budget takes: days, device-hours, cost), failures (goodput under
  failures: full restarts, replica fault tolerance);
- calibration to runs (`plan.calibrate`): calibrate (the command), calibrate_fit (the least squares);
- output: report, columns (plain-text tables), charts (`plan.chart`: the comparison's bars, the fit's
  measured vs predicted).
"""

from __future__ import annotations

import dataclasses
import sys

from launcher.config.layout_keys import from_config, launch_world_size, plan_world_size
from launcher.config.options import BuildOptions
from launcher.config.precision import fp8_options, precision_mode
from launcher.config.schema import DataConfig, TrainConfig, compile_enabled
from launcher.config.validate import compared_profiles, validate
from launcher.errors import LauncherError
from launcher.flops import GIB, device_flop_per_byte
from launcher.hardware.resolve import peak_flops
from launcher.layout import Layout, async_tp_applies, worker_threads, workers_per_node
from launcher.planner.budget import Row, budget, compared_nodes, ft_budget
from launcher.planner.charts import chart_path, compare_line, say
from launcher.planner.predict import Prediction, Problem, predict
from launcher.planner.report import batch_text, budget_block, compare_table, precision_table, to_json, to_table
from launcher.planner.request import core_share, fp8_of, problem, space
from launcher.planner.search import Result, search

__all__ = ["resolve", "build_options", "run_plan", "plan", "Prediction", "Layout"]

# `auto` here: the planner chooses
SEARCHED = ("tp", "pp", "cp", "ep", "pp_schedule", "recompute", "recompute_layers", "batch.micro")


def plan(
    cfg: TrainConfig, world: int, explore: bool = False, fused_attention: bool = True, top: int = 0
) -> tuple[Problem, Result]:
    """Search every layout `cfg` allows on `world` devices in the precision `train` runs it (dtype=auto:
    bf16 on accelerators; the caller has validated `cfg`); raise if none is valid.
    `fused_attention=False`: attention as runs before FlashAttention ran it (published runs). `top` > 0:
    rank only the best `top` (the rest counted in `Result.fit`)."""
    prob = dataclasses.replace(problem(cfg, world), fused_attention=fused_attention)
    res = search(prob, space(cfg, world, explore), top)
    if not res.ranked:
        raise _no_layout(cfg, prob, res)
    return prob, res


def side_by_side(cfg: TrainConfig, prob: Problem, best: Prediction) -> list[Prediction]:
    """`best`'s layout in bf16 and in fp8, where fp8 is asked for or the profile has FP8 units (dtype=auto:
    the option, beside what `train` runs; empty otherwise)."""
    fp8 = prob.fp8 or fp8_of(cfg, auto=True)
    if fp8 is None:
        return []
    bf16 = dataclasses.replace(prob, fp8=None, elem=2)
    return [predict(bf16, best.layout), predict(dataclasses.replace(prob, fp8=fp8), best.layout)]


def run_plan(cfg: TrainConfig) -> None:
    if cfg.plan.format not in ("table", "wide", "json"):
        raise LauncherError(f"plan.format={cfg.plan.format!r} is unknown: use table, wide (every column) or json")
    validate(cfg)  # the same checks, ranges first, that `train` applies (planner.resolve)
    chart = chart_path(cfg.plan.chart, bool(cfg.plan.compare), cfg.plan.calibrate is not None)
    if cfg.plan.calibrate is not None:  # fit the profile to the user's runs instead (planner/calibrate.py)
        from launcher.planner.calibrate import calibrate

        calibrate(cfg.plan.calibrate, cfg.hardware, cfg.plan.calibrate_out, cfg.cache_dir, cfg.plan.format, chart=chart)
        return
    world = plan_world_size(cfg)
    top = 0 if cfg.plan.tokens else cfg.plan.top  # a token budget groups every layout (ft_budget)
    prob, res = plan(cfg, world, explore=cfg.plan.explore, top=top)
    shown = res.ranked[: cfg.plan.top] if cfg.plan.top else res.ranked
    tokens = cfg.plan.tokens
    budgets = [budget(p, tokens, cfg.hardware, cfg.ft, prob.machine) for p in shown] if tokens else None
    grouped = ft_budget(res.ranked, tokens, cfg.hardware, cfg.ft, prob.machine) if tokens else None
    rows = compare(cfg, world) if cfg.plan.compare else None
    at = f"{world:,} devices" if cfg.plan.compare_at == "devices" else f"the spend of {world:,} x {prob.machine.name}"
    what = f"{cfg.model.name}, each profile's best layout at {at}"
    if cfg.plan.format == "json":
        to_json(shown, budgets, rows)
        if rows and chart:  # its line on stderr: stdout stays one JSON document
            say(compare_line(rows, tokens, what, chart), sys.stderr)
        return
    dtypes = ", ".join(sorted({p.dtype for p in shown}))
    title = (
        f"{cfg.model.name} on {world:,} x {prob.machine.name} ({cfg.nodes:,} node{'s' * (cfg.nodes > 1)}), {dtypes}: "
        f"{res.fit:,} of {res.tried:,} layouts fit, the best {len(shown)} by tokens/s"
    )
    to_table(shown, [title, batch_text(cfg.batch.get("global"), shown, prob.seq)], wide=cfg.plan.format == "wide")
    if pair := side_by_side(cfg, prob, shown[0]):
        option = " (dtype=auto) and in fp8 (dtype=fp8)" if prob.fp8 is None else " and fp8"
        precision_table(pair, f"layout #1 in bf16{option}; MFU against the bf16 peak")
    if budgets:
        budget_block(budgets[0], prob.machine.name, grouped)
    if rows:
        compare_table(rows, tokens, what)
        if chart:
            say(compare_line(rows, tokens, what, chart))


def compare(cfg: TrainConfig, world: int) -> list[Row]:
    """`plan.compare`: each profile's own best layout, on `world` devices (plan.compare_at=devices) or
    on the nodes the run's hourly spend rents (budget), and that layout's budget; a profile that no
    layout fits gets the line that says why (for the first node count tried)."""
    spend = world * cfg.hardware.price_per_hour if cfg.plan.compare_at == "budget" else None
    rows = []
    for hw in compared_profiles(cfg):
        row = None
        for nodes in compared_nodes(world, hw, spend):
            other = dataclasses.replace(cfg, hardware=hw, nodes=nodes)
            try:
                best = plan(other, plan_world_size(other), explore=cfg.plan.explore, top=1)[1].ranked[0]
            except LauncherError as e:
                row = row or Row(hw, nodes, error=str(e))
                continue
            row = Row(hw, nodes, best, budget(best, cfg.plan.tokens, hw))
            break
        rows.append(row)
    return rows


def searched(cfg: TrainConfig) -> list[str]:
    """The keys left `auto` that the planner chooses (the dp degrees alone are filled by the rule)."""
    return [k for k in SEARCHED if (cfg.batch.get("micro") if k == "batch.micro" else getattr(cfg, k)) == "auto"]


def resolve(cfg: TrainConfig, env_world_size: int | None = None) -> tuple[Layout, Prediction, BuildOptions]:
    """The run's layout, the planner's prediction for it, and how to build it. Keys left `auto` take
    the fastest layout that fits the launch's world size; a layout predicted not to fit is refused
    (force=true runs it, a dry run only reports it)."""
    validate(cfg)
    world = launch_world_size(cfg, env_world_size)
    auto = searched(cfg)
    if auto:
        if world is None:
            raise LauncherError(
                f"{auto[0]}=auto needs a world size, which the cpu profile takes from the degrees: "
                f"give {auto[0]} a value"
            )
        best = plan(cfg, world, top=1)[1].ranked[0]
        return best.layout, best, build_options(cfg, best.layout)
    layout = from_config(cfg, world)
    prediction = predict(problem(cfg, layout.world_size), layout)
    if not prediction.fits and not (cfg.force or cfg.dry_run):
        raise too_big(cfg, prediction)
    return layout, prediction, build_options(cfg, layout)


def build_options(cfg: TrainConfig, layout: Layout) -> BuildOptions:
    """What the runtime needs of `cfg` beyond `layout`, each decision taken here once."""
    hw = cfg.hardware
    threads = worker_threads(cfg.threads, workers_per_node(layout.world_size, cfg.nodes))
    return BuildOptions(
        seed=cfg.seed,
        precision=precision_mode(cfg.dtype, hw.kind, layout),
        compile=compile_enabled(cfg),
        async_tp=async_tp_applies(layout, cfg.async_tp),
        seq_len=cfg.seq_len,
        init_from=cfg.init.get("from") or None,
        device=hw.kind,
        threads=threads,
        # a CPU worker's share of its cores, as the planner counts it: MFU measured and predicted alike
        peak_flops=peak_flops(hw, threads, cfg.cache_dir)
        * (core_share(cfg, layout.world_size) if hw.kind == "cpu" else 1),
        flop_per_byte=device_flop_per_byte(hw.kind, hw.peak_tflops, hw.memory_bandwidth_gbs),
        fp8=fp8_options(cfg.dtype, cfg.fp8, hw, layout),
        document_eos=document_eos(cfg.data),
    )


def document_eos(data: DataConfig) -> int | None:
    """The id ending each document under data.document_mask; None without it (the data package, and
    torch with it, only then: `plan` imports no torch on accelerator profiles)."""
    if not data.document_mask:
        return None
    from launcher.data.documents import end_of_document

    return end_of_document(data)


def too_big(cfg: TrainConfig, prediction: Prediction) -> LauncherError:
    mem = prediction.memory.as_gib()
    return LauncherError(
        f"predicted {mem['total']:.1f} GiB per device (params+grads+optimizer "
        f"{mem['params'] + mem['grads'] + mem['optimizer']:.1f}, activations {mem['activations']:.1f}) "
        f"exceeds hardware.memory_gib={cfg.hardware.memory_gib}: use recompute=full, a smaller "
        "batch.micro, more tp/pp/cp/dp_shard, or force=true"
    )


def _no_layout(cfg: TrainConfig, prob: Problem, res: Result) -> LauncherError:
    if res.smallest is not None:
        s, lay = res.smallest, res.smallest.layout
        return LauncherError(
            f"model {cfg.model.name} fits no layout on {prob.world} x {prob.machine.name}: the smallest "
            f"needs {s.memory.total / GIB:.1f} GiB per device (tp={lay.tp} pp={lay.pp} dp={lay.dp} "
            f"{lay.sharding} micro={lay.micro} recompute={lay.recompute}) but hardware.memory_gib="
            f"{cfg.hardware.memory_gib}: add nodes, lower seq_len or batch.micro, or a bigger profile"
        )
    if res.broken is not None:  # the same line `train` prints for this layout
        return LauncherError(res.broken)
    return LauncherError(
        f"no layout of {prob.world} devices satisfies tp/pp/cp/dp/dp_shard/dp_replicate as given for model "
        f"{cfg.model.name}: set some of them to auto"
    )
