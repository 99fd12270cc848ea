"""Context parallelism against the planner: `python -m bench context [--steps 8] [--batch 4] [--seq-len 512]`.

1. Memory: the bytes autograd saves for one block forward on a cp=2 rank (saved-tensor hooks; the
   parameters, the RoPE table and the cached causal masks excluded), next to the planner's
   `layer_activation_bytes` for its seq / cp tokens; and the same at cp=1. Exact equality expected.
2. Step time: the `small` model at cp=1 (one process) and cp=2 (two processes, FSDP over the cp
   ranks), the same global batch, measured side by side in one run, next to the planner's step time
   for the same config (`planner.resolve`). The machine is shared: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.planner_accuracy import TOLERANCE, block_saved_bytes, resolved_config, timing_worker
from launcher.config.layout_keys import from_config
from launcher.layout import build_mesh
from launcher.model.init import materialize, meta_model
from launcher.parallel.context import apply_context_parallel
from launcher.planner import resolve
from launcher.planner.activations import layer_activation_bytes


def block_memory_worker(rank: int, world: int, seq_len: int) -> dict[str, Any]:
    """One block of the `small` model on this cp rank (no FSDP: the saved tensors are the question)."""
    cfg = resolved_config(1, 1, 1, seq_len, 1, f"cp={world}")
    lay = from_config(cfg, world)
    model = meta_model(cfg.model)
    if world > 1:
        apply_context_parallel(model, build_mesh(lay)["cp"], seq_len)
    materialize([model], cfg.seed, torch.device("cpu"))
    local = seq_len // lay.cp
    rope = model.positions(model.rope, 1)  # the table Transformer.forward hands every block
    attention = model.layers["0"].attention
    constants: tuple[torch.Tensor, ...] = ()
    if world > 1:  # built once per run: the key order and the chunks' masks (chunk 0 has none)
        shard, cpu = attention.core.shard, torch.device("cpu")
        constants = (shard.key_order(cpu), *(shard.mask(j, cpu, torch.float32) for j in shard.chunks if j))
    torch.manual_seed(rank)
    x = torch.randn(1, local, cfg.model.dim, requires_grad=True)
    saved, detail = block_saved_bytes(model.layers["0"], rope, x, constants)
    predicted = layer_activation_bytes(cfg.model, seq_len, lay, 4)[0] * local
    return {"cp": lay.cp, "predicted": predicted, "measured": saved, "detail": detail}


def memory_rows(seq_len: int) -> list[dict[str, Any]]:
    from tests.dist import run

    return [block_memory_worker(0, 1, seq_len), run(block_memory_worker, 2, seq_len, timeout=300)[0]]


def step_time_rows(seq_len: int, batch: int, steps: int, threads: int | None) -> list[dict[str, Any]]:
    from tests.dist import run

    rows = []
    for cp in (1, 2):  # one after the other: each run has the machine's cores to itself
        cfg = resolved_config(1, 1, 1, seq_len, batch, f"cp={cp}", *([f"threads={threads}"] if threads else []))
        per_rank = run(timing_worker, cp, [cfg], steps, timeout=1800)
        _, prediction, _ = resolve(cfg, cp)
        seconds = max(r[0] for r in per_rank)  # the step ends when the slowest rank ends
        pred = prediction.as_dict()
        rows.append({"cp": cp, "predicted": pred["step_time_s"], "measured": seconds, "time_s": pred["time_s"]})
    return rows


def main(argv: list[str]) -> None:
    from rich.console import Console

    parser = argparse.ArgumentParser(prog="python -m bench context", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (median)")
    parser.add_argument("--threads", type=int, default=None, help="threads per worker (default: the runtime's)")
    args = parser.parse_args(argv)
    console = Console()
    for r in memory_rows(args.seq_len):
        console.print(
            f"memory cp={r['cp']}: one block saves {r['measured'] / 2**20:.3f} MiB, planner "
            f"{r['predicted'] / 2**20:.3f} MiB ({'exact' if r['measured'] == r['predicted'] else 'DIFFERENT'})"
        )
    rows = step_time_rows(args.seq_len, args.batch, args.steps, args.threads)
    for r in rows:
        ratio, ts = r["predicted"] / r["measured"], r["time_s"]
        inside = "within" if abs(ratio - 1) <= TOLERANCE else "OUTSIDE"
        console.print(
            f"step time cp={r['cp']} (small, {args.batch} x {args.seq_len}): predicted {r['predicted']:.3f} s, "
            f"measured {r['measured']:.3f} s, ratio {ratio:.2f} ({inside} ±25%); compute {ts['compute']:.3f}, "
            f"cp comm {ts['cp_comm']:.4f}, dp exposed {ts['dp_exposed']:.3f}"
        )
    console.print(
        f"cp=2 / cp=1 step time: measured {rows[1]['measured'] / rows[0]['measured']:.2f}, "
        f"predicted {rows[1]['predicted'] / rows[0]['predicted']:.2f}"
    )
