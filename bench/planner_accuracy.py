"""The planner against this CPU: `python -m bench planner_accuracy [--steps 12] [--batch 8] [--seq-len 256]`.

1. Step time: for tp, pp, dp in {1, 2} (8 layouts, FSDP when dp = 2, 1F1B when pp = 2) on the
   `small` model with the calibrated `cpu` profile, the median step time of a short run (the
   slowest rank's median; threads per worker as the runtime picks them: cores // world, at least 1)
   next to the planner's `step_time_s` for the same resolved config and world size (`check`), their
   ratio, whether it is within +-25%, and the predicted components. No constant is tuned per layout.
   The calibrated GEMM peak the planner reads from the cache is shown next to one measured now: a
   cache written while the machine was busy would make every prediction slow by the same factor.
2. Memory: per-rank parameters (planner `rank_params`, and FSDP's shard) against what the parallel
   model holds, and activation bytes of one layer (`layer_activation_bytes`, fp32, recompute=none)
   against the bytes autograd saves for one block forward, counted with saved-tensor hooks
   (bench/parallel.py's SavedTensorMeter; parameters and the RoPE table excluded). tp=1 in this
   process, tp=2 (and FSDP dp=2) in two gloo processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.parallel import LAYOUTS, SavedTensorMeter, train_step
from launcher.config.layout_keys import from_config
from launcher.config.schema import TrainConfig, compose_config
from launcher.flops import head_dim
from launcher.layout import build_mesh, worker_threads
from launcher.model.attention import rope_tables
from launcher.model.init import meta_model
from launcher.model.transformer import Block
from launcher.parallel import build_runner
from launcher.parallel.pipeline import stage_module
from launcher.planner import build_options, resolve
from launcher.planner.activations import layer_activation_bytes
from launcher.planner.memory import rank_memory, rank_params
from launcher.train.optim import build_optimizer

TOLERANCE = 0.25  # step time
ACT_TOLERANCE = 0.15  # activation bytes per layer


def resolved_config(tp: int, pp: int, dp: int, seq_len: int, batch: int, *overrides: str) -> TrainConfig:
    """The config `train` would run for this layout: `batch` sequences per step in 2 pp microbatches
    per dp rank when pipelined (the default), so micro = batch / (dp 2 pp)."""
    mb = 2 * pp if pp > 1 else 1
    return compose_config(
        "+model=small", "hardware=cpu", f"tp={tp}", f"pp={pp}", f"dp={dp}", "pp_schedule=1f1b", f"seq_len={seq_len}",
        f"batch.global={batch}", f"batch.micro={batch // (dp * mb)}", *overrides,
    )  # fmt: skip


def local_numel(module: torch.nn.Module) -> int:
    """Parameter elements this rank holds (the local shard of DTensors), each parameter once."""
    seen: dict[int, int] = {}
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        seen[id(p)] = local.numel()
    return sum(seen.values())


# ------------------------------------------------------------------------------------------- step time


def timing_worker(rank: int, world: int, cfgs: list[TrainConfig], steps: int) -> list[float]:
    out = []
    for cfg in cfgs:
        torch.set_num_threads(worker_threads(cfg.threads, world))  # what train() does
        layout = from_config(cfg, world)
        runner = build_runner(cfg.model, layout, build_mesh(layout), build_options(cfg, layout), torch.device("cpu"))
        optimizer, _ = build_optimizer(runner.parts, cfg.optim, 100)
        glob = layout.global_batch
        local = glob // layout.dp
        coords = layout.coordinates(rank)
        gen = torch.Generator().manual_seed(0)
        batches = [
            torch.randint(0, cfg.model.vocab_size, (glob, cfg.seq_len + 1), generator=gen)[
                coords["dp"] * local : (coords["dp"] + 1) * local
            ]
            for _ in range(steps + 2)
        ]
        cp = (layout.cp, coords["cp"])
        for tokens in batches[:2]:  # warm-up: allocations, pipeline shape inference
            train_step(runner, optimizer, tokens, *cp)
        times = []
        for tokens in batches[2:]:
            t0 = time.perf_counter()
            train_step(runner, optimizer, tokens, *cp)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def step_time_rows(seq_len: int, batch: int, steps: int) -> list[dict[str, Any]]:
    from tests.dist import run

    rows = []
    for world in (1, 2, 4, 8):
        lays = [lay for lay in LAYOUTS if lay["tp"] * lay["pp"] * lay["dp"] == world]
        cfgs = [resolved_config(lay["tp"], lay["pp"], lay["dp"], seq_len, batch) for lay in lays]
        per_rank = run(timing_worker, world, cfgs, steps, timeout=1800)
        for i, (lay, cfg) in enumerate(zip(lays, cfgs)):
            layout, prediction, _ = resolve(cfg, world)
            pred = prediction.as_dict()
            measured = max(r[i] for r in per_rank)  # the step ends when the slowest rank ends
            rows.append(
                {**lay, "world": world, "threads": worker_threads(cfg.threads, min(world, cfg.max_local_workers)),
                 "micro": layout.micro, "mb": layout.microbatches, "predicted": pred["step_time_s"],
                 "measured": measured, "ratio": pred["step_time_s"] / measured, "time_s": pred["time_s"]}
            )  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------- memory


def block_saved_bytes(
    block: torch.nn.Module, rope: torch.Tensor, x: torch.Tensor, constants: tuple[torch.Tensor, ...] = ()
) -> tuple[int, list[tuple]]:
    """Bytes autograd saves for one block forward (each storage once), and (shape, dtype, bytes) of each.
    Parameters, the RoPE table and `constants` (built once per run, e.g. context parallelism's mask)
    are not activations."""
    exclude = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in block.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in (rope, *constants)}
    seen: list[tuple] = []

    class Meter(SavedTensorMeter):
        def pack(self, t: torch.Tensor) -> Any:
            local = getattr(t, "_local_tensor", t)
            key = local.untyped_storage().data_ptr()
            if key not in self.exclude and key not in self.refs:
                seen.append(
                    (tuple(local.shape), str(local.dtype).removeprefix("torch."), local.untyped_storage().nbytes())
                )
            return super().pack(t)

    with Meter(exclude) as meter:
        out = block(x, rope)
    out.sum().backward()
    return meter.peak, seen


def single_process_memory(seq_len: int) -> dict[str, Any]:
    """tp=1 activations of one block, and parameters of each pipeline stage (pp=2)."""
    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    cfg = resolved_config(1, 1, 1, seq_len, 1)
    m = cfg.model
    torch.manual_seed(0)
    block = Block(m)
    rope = rope_tables(head_dim(m), m.max_seq_len, m.rope_theta, torch.device("cpu"))
    x = torch.randn(1, seq_len, m.dim, requires_grad=True)
    saved, detail = block_saved_bytes(block, rope, x)
    lay = from_config(cfg, 1)
    predicted = layer_activation_bytes(m, seq_len, lay, 4)[0] * seq_len
    out: dict[str, Any] = {"act": [{"tp": 1, "predicted": predicted, "measured": saved, "detail": detail}]}
    params = [
        {
            "case": "tp=1",
            "rank": 0,
            "predicted": rank_params(m, lay, 0),
            "held": local_numel(meta_model(cfg.model)),
        }
    ]
    for tied in (False, True):  # tied: the last stage holds a copy of the embedding (parallel/tied.py)
        pcfg = resolved_config(1, 2, 1, seq_len, 4, f"model.tied_embeddings={str(tied).lower()}")
        model, play, case = meta_model(pcfg.model), from_config(pcfg, 2), "pp=2 tied" if tied else "pp=2"
        for stage in range(2):
            predicted, held = rank_params(pcfg.model, play, stage), local_numel(stage_module(model, stage, 2))
            params.append({"case": case, "rank": stage, "predicted": predicted, "held": held})
    out["params"] = params
    return out


def two_rank_worker(rank: int, world: int, seq_len: int) -> dict[str, Any]:
    """tp=2: parameters per rank and one block's saved bytes; FSDP dp=2: the parameter shard."""
    cfg = resolved_config(2, 1, 1, seq_len, 1)
    m = cfg.model
    lay = from_config(cfg, world)
    runner = build_runner(cfg.model, lay, build_mesh(lay), build_options(cfg, lay), torch.device("cpu"))
    model = runner.parts[0]
    torch.manual_seed(0)
    x = torch.randn(1, seq_len, m.dim, requires_grad=True)
    saved, detail = block_saved_bytes(model.layers["0"], model.rope, x)
    out = {
        "act": {"tp": 2, "predicted": layer_activation_bytes(m, seq_len, lay, 4)[0] * seq_len, "measured": saved,
                "detail": detail},
        "params": [{"case": "tp=2", "rank": rank, "predicted": rank_params(m, lay, 0), "held": local_numel(model)}],
    }  # fmt: skip
    fcfg = resolved_config(1, 1, 2, seq_len, 2)
    flay = from_config(fcfg, world)
    frunner = build_runner(fcfg.model, flay, build_mesh(flay), build_options(fcfg, flay), torch.device("cpu"))
    shard = rank_memory(m, seq_len, flay, 4, "cpu", 0).params / 4  # fp32 master bytes / 4 = elements
    out["params"].append({"case": "fsdp dp=2", "rank": rank, "predicted": shard, "held": local_numel(frunner.parts[0])})
    return out


def memory_rows(seq_len: int) -> dict[str, Any]:
    from tests.dist import run

    single = single_process_memory(seq_len)
    ranks = run(two_rank_worker, 2, seq_len, timeout=300)
    return {
        "act": single["act"] + [ranks[0]["act"]],
        "params": single["params"] + [p for r in ranks for p in r["params"]],
    }


# ------------------------------------------------------------------------------------------------ main


def step_time_report(console: Console, seq_len: int, batch: int, steps: int) -> None:
    """The step-time table (planner vs runtime, every layout) and the GEMM peak it was predicted with."""
    from launcher.hardware.probes import measure_gemm_flops, offer_gemm_peak
    from launcher.hardware.resolve import peak_flops

    cores = os.cpu_count() or 1
    base = resolved_config(1, 1, 1, seq_len, batch)
    threads = sorted({max(cores // w, 1) for w in (1, 2, 4, 8)})
    cached = {t: peak_flops(base.hardware, t, base.cache_dir) for t in threads}
    t0 = time.perf_counter()
    rows = step_time_rows(seq_len, batch, steps)
    elapsed = time.perf_counter() - t0
    now = {t: measure_gemm_flops(t, seconds=1.0) for t in threads}  # after the runs: the cache is kept
    table = Table(
        title=f"planner vs runtime: small, fp32, global batch {batch} x {seq_len}, {steps} steps "
        f"(median), {cores} cores",
    )
    for col in ("tp", "pp", "dp", "ranks", "thr", "micro x mb", "predicted s", "measured s", "pred/meas", "±25%"):
        table.add_column(col, justify="right")
    for col in ("compute", "tp comm", "tp host", "pp p2p", "bubble", "dp exposed"):
        table.add_column(col, justify="right", style="dim")
    for r in sorted(rows, key=lambda r: (r["world"], r["pp"], r["dp"], r["tp"])):
        ok = abs(r["ratio"] - 1) <= TOLERANCE
        ts = r["time_s"]
        table.add_row(
            str(r["tp"]), str(r["pp"]), str(r["dp"]), str(r["world"]), str(r["threads"]),
            f"{r['micro']} x {r['mb']}", f"{r['predicted']:.3f}", f"{r['measured']:.3f}", f"{r['ratio']:.2f}",
            "[green]yes[/]" if ok else "[red]no[/]",
            *(f"{ts[k]:.3f}" for k in ("compute", "tp_comm", "tp_host", "pp_p2p", "pp_bubble", "dp_exposed")),
        )  # fmt: skip
    console.print(table)
    inside = sum(abs(r["ratio"] - 1) <= TOLERANCE for r in rows)
    console.print(f"{inside}/{len(rows)} layouts within ±25% ({elapsed:.0f} s)")
    console.print(
        "calibrated fp32 GEMM peak (cache the planner reads) vs measured now: "
        + ", ".join(f"{t} thr {cached[t] / 1e9:.0f} vs {now[t] / 1e9:.0f} GFLOP/s" for t in threads)
    )
    worst = max(now[t] / cached[t] for t in threads)
    if worst > 1.1 or min(now[t] / cached[t] for t in threads) < 0.9:
        console.print("[yellow]the cached peak differs from now by >10%: it may come from a noisy run[/]")
    for t in threads:  # a peak is a maximum: a clearly higher one replaces the cached one for later runs
        if raised := offer_gemm_peak(t, base.cache_dir, now[t]):
            console.print(raised)


def memory_report(console: Console, seq_len: int) -> None:
    """Activation bytes of one layer and parameters per rank: planner vs the parallel model."""
    mem = memory_rows(seq_len)
    act = Table(title=f"activation bytes of one layer: small (SwiGLU, GQA 8/4 heads), 1 x {seq_len}, fp32")
    for col in ("tp", "predicted MiB", "saved (hook) MiB", "pred/meas", "±15%"):
        act.add_column(col, justify="right")
    for a in mem["act"]:
        ratio = a["predicted"] / a["measured"]
        act.add_row(
            str(a["tp"]), f"{a['predicted'] / 2**20:.3f}", f"{a['measured'] / 2**20:.3f}", f"{ratio:.3f}",
            "[green]yes[/]" if abs(ratio - 1) <= ACT_TOLERANCE else "[red]no[/]",
        )  # fmt: skip
    console.print(act)
    for a in mem["act"]:
        shapes = ", ".join(f"{'x'.join(map(str, s))}" for s, _, _ in a["detail"])
        console.print(f"tp={a['tp']} saved tensors (per rank, distinct storages): {shapes}")
    par = Table(title="parameters per rank: planner vs parallel model")
    for col in ("layout", "rank", "predicted", "held", "equal"):
        par.add_column(col, justify="right")
    for p in mem["params"]:
        eq = p["predicted"] == p["held"]
        par.add_row(
            p["case"], str(p["rank"]), f"{p['predicted']:,.0f}", f"{p['held']:,}", "yes" if eq else "[red]no[/]"
        )
    console.print(par)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench planner_accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per layout (median)")
    parser.add_argument("--skip-time", action="store_true", help="memory comparison only")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:  # piped to a file: wide enough for the step-time table
        console = Console(width=170)
    if not args.skip_time:
        step_time_report(console, args.seq_len, args.batch, args.steps)
    memory_report(console, args.seq_len)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
