"""The simulation beside the planner: one row per pipeline position, per category, and the JSON.

The planner's figures are `planner.memory.rank_memory` for the same pipeline rank (its busiest-device
`Prediction` is the larger of the first and the last). Categories compared: parameters, gradients,
optimizer state, and the working set (the tracker's activations, temporaries and module buffers; the
planner's activations, logits and compute-dtype buffers: the two split a gathered or cast weight
differently). What the tracker cannot see (the planner's `overhead`: CUDA context, NCCL's buffers,
workspaces, the allocator's fragmentation) is added to both peaks as the planner adds it, and named.
A mixture of experts is simulated with its routing balanced (`balanced`: fake tensors have no values to
route by; the planner's memory assumes a balanced load too).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.config.precision import precision_text
from launcher.config.prediction import Memory
from launcher.config.run import Run
from launcher.errors import LauncherError
from launcher.flops import GIB
from launcher.layout import Layout, rank_of
from launcher.layout.text import describe
from launcher.planner.memory import rank_layers, rank_memory
from launcher.planner.predict import Problem, with_fp8

NOT_SEEN = "CUDA context, NCCL buffers, cuBLAS workspaces, allocator fragmentation"
NOT_RUN = "CUDA-only branches (fake CUDA tensors, cuda meshes, SDPA's flash kernels), compile"
# context parallelism on a GPU profile: the CPU's chunk masks, where a GPU's flash kernel takes torch's causal bias
NOT_MASKED = "cp's causal bias (the CPU's chunk masks are held instead: (seq/2cp)^2 x 2cp elements at most)"
# a mixture of experts besides (`balanced`; the grouped GEMM is CUDA's: the experts' loop runs)
NOT_ROUTED = "the router's top-k choice (routing balanced), the experts' grouped GEMM"
COLUMNS = ("params", "grads", "optimizer", "working", "peak")


def check(run: Run) -> None:
    """Refuse what the simulation cannot represent: one line, exit 2 (a LauncherError)."""
    if run.record.get("hardware", {}).get("kind") == "tpu":
        raise LauncherError(
            "simulate=true: a TPU profile's step runs under XLA, whose memory torch's fake tensors do not show: "
            "use `plan` for its prediction, or a cuda or cpu hardware profile"
        )
    if run.data.document_mask:
        raise LauncherError(
            "simulate=true: data.document_mask reads token values, which fake tensors do not have: "
            "set data.document_mask=false"
        )


def balanced(run: Run) -> Run:
    """The run as simulated: a mixture of experts routes round-robin (`model.moe.force_balance`), every expert
    the same rows, known without reading a tensor; a dense model as it is."""
    moe = run.model.moe
    if not moe.experts or moe.force_balance:
        return run
    return replace(run, model=replace(run.model, moe=replace(moe, force_balance=True)))


def predicted(prob: Problem, layout: Layout, pp_rank: int) -> Memory:
    """The planner's memory for pipeline rank `pp_rank` of `layout` in `prob` (`planner.request.problem`)."""
    mach, m = prob.machine, prob.model
    mem = rank_memory(m, prob.seq, layout, prob.elem, mach.kind, pp_rank, mach.flop_per_byte, prob.fused_attention)
    return with_fp8(prob, layout, mem, rank_layers(m.n_layers, layout.pp, layout.chunks, layout.v_shape)[pp_rank])


def simulated_gib(peak: dict[str, int]) -> dict[str, float]:
    """The tracker's bytes as the compared columns, in GiB (with every category it names)."""
    working = peak["activations"] + peak["temporaries"] + peak["buffers"] + peak["other"]
    out = {k: peak[k] / GIB for k in ("params", "grads", "optimizer")} | {"working": working / GIB}
    out["peak"] = peak["total"] / GIB
    return out | {f"tracked_{k}": v / GIB for k, v in peak.items() if k != "total"}


def predicted_gib(mem: Memory) -> dict[str, float]:
    """The planner's parts as the compared columns, in GiB; `peak` without the overhead (it is added apart)."""
    working = mem.activations + mem.logits + mem.buffers
    out = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "working": working}
    out["peak"] = mem.total - mem.overhead
    return {k: v / GIB for k, v in out.items()} | {"overhead": mem.overhead / GIB}


def simulate(
    run: Run, prob: Problem, out: Callable[[str], None] = print, json_path: Path | None = None
) -> dict[str, Any]:
    """Simulate one rank of each pipeline position of `run`'s layout beside the planner's memory for `prob` (the
    same run's problem: `planner.request.problem`); print the table; return (and write) the JSON."""
    from launcher.simulate.step import DEVICE

    check(run)
    layout, options = run.layout, run.options
    out(header(run, prob.machine.name, DEVICE))
    if run.model.moe.experts:
        run = balanced(run)
        out(
            f"routing: balanced, token t's pick j to expert (t x {run.model.moe.top_k} + j) mod "
            f"{run.model.moe.experts} (model.moe.force_balance: fake tensors have no values to route by; "
            "the planner assumes a balanced load too)"
        )
    for line in TABLE_HEAD:
        out(line)
    rows = []
    for pp_rank in range(layout.pp):  # each row as it is done: a 405b layout takes minutes
        rows.append(position(run, prob, pp_rank))
        out(row_line(rows[-1]))
    overhead = rows[0]["predicted_gib"]["overhead"]
    busiest = {k: round(max(r[f"{k}_gib"]["peak"] for r in rows) + overhead, 3) for k in ("simulated", "predicted")}
    out(
        f"+ {overhead:.2f} GiB per device the tracker cannot see ({NOT_SEEN}), as the planner adds it: busiest rank "
        f"{busiest['simulated']:.2f} GiB simulated · {busiest['predicted']:.2f} GiB predicted "
        f"({delta(busiest['simulated'], busiest['predicted'])})"
    )
    masked = layout.cp > 1 and prob.machine.kind != "cpu"
    not_run = ", ".join([NOT_RUN] + [NOT_ROUTED] * bool(run.model.moe.experts) + [NOT_MASKED] * masked)
    out(f"not simulated: {not_run} (device {DEVICE}; docs/simulate.md)")
    keys = ("tp", "pp", "cp", "dp_replicate", "dp_shard", "micro", "microbatches", "schedule", "recompute")
    result = {
        **{"model": run.model.name, "hardware": prob.machine.name, "world": layout.world_size},
        **{"layout": {k: getattr(layout, k) for k in keys}, "device": DEVICE, "precision": options.precision},
        **({"routing": "balanced"} if run.model.moe.experts else {}),
        **{"overhead_gib": overhead, "not_seen": NOT_SEEN, "not_simulated": not_run},
        **{"ranks": rows, "busiest_gib": busiest},
    }
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        out(f"wrote {json_path}")
    return result


def position(run: Run, prob: Problem, pp_rank: int) -> dict[str, Any]:
    """One pipeline position's row: its rank, stages, figures simulated and predicted (GiB), seconds taken."""
    from launcher.simulate.step import rank_peak

    layout, t0 = run.layout, time.perf_counter()
    sim = simulated_gib(rank_peak(run, pp_rank))
    return {
        "pp": pp_rank,
        "rank": rank_of(layout, pp=pp_rank),
        "stages": layout.pp_stages(pp_rank) if layout.pp > 1 else [0],
        "simulated_gib": rounded(sim),
        "predicted_gib": rounded(predicted_gib(predicted(prob, layout, pp_rank))),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def header(run: Run, hardware: str, device: str) -> str:
    """The run's first line, as train's names the layout (`layout.describe`)."""
    layout, options = run.layout, run.options
    return (
        f"simulate: {run.model.name} on {hardware}, {layout.world_size:,} ranks · {describe(layout)} x "
        f"{options.seq_len} tokens · {precision_text(options.precision, options.fp8)} · one rank per pipeline "
        f"position, a step (optimizer state allocated) on fake tensors ({device})"
    )


def rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


def delta(sim: float, plan: float) -> str:
    return f"planner {(plan - sim) / sim:+.0%}" if sim else "nothing simulated"


TABLE_HEAD = (
    "GiB per rank, simulated / predicted (working: activations, temporaries, buffers)",
    f"{'pp':>3} {'rank':>6}  " + "  ".join(f"{c:>13}" for c in COLUMNS) + "   planner vs simulated   time",
)


def row_line(row: dict[str, Any]) -> str:
    """One pipeline position: each column simulated / predicted, GiB; the planner's error on the peak."""
    sim, plan = row["simulated_gib"], row["predicted_gib"]
    cells = "  ".join(f"{sim[c]:>6.2f}/{plan[c]:<6.2f}" for c in COLUMNS)  # 120 columns at 999.99 GiB
    verdict = delta(sim["peak"], plan["peak"])
    return f"{row['pp']:>3} {row['rank']:>6}  {cells}   {verdict:<20} {row['seconds']:>5.1f} s"
