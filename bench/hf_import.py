"""Issue 13 figure: `init.from` reads only each rank's own boxes of the Hugging Face folder's tensors.

`125m` as a folder that transformers writes (LlamaForCausalLM, fp32, 200 MB shards); `steps=0`
builds it for real (allocate, initialize, stop) with the seeded random init and from the folder,
in one process and under tp=2, one fresh `train` process tree each. Printed side by side: build
time and peak RSS per rank, beside the whole model's fp32 size. Goal: the import adds less than the
model's share per rank over the random init (a rank that read the whole model would add all of it).
Noisy on a shared machine: compare the rows of one run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.memory import model_bytes, ranks_text, train
from launcher.config.schema import compose_config
from launcher.flops import GIB

MODEL = ["+model=125m"]
LAYOUTS = {"1 process": [], "tp=2": ["tp=2"]}


def write_folder(path: Path) -> None:
    """The model's shapes as transformers saves a LlamaForCausalLM."""
    import torch
    import transformers

    m = compose_config(*MODEL).model
    config = transformers.LlamaConfig(
        hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads or m.n_heads, vocab_size=m.vocab_size, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tied_embeddings,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="200MB")


def main(argv: list[str]) -> None:
    console = Console(width=200)
    cache = os.environ.get("LAUNCHER_BENCH_CACHE", str(Path.home() / ".cache" / "launcher"))
    whole, _ = model_bytes(MODEL)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        write_folder(tmp / "llama-125m")
        table = Table(title=f"125m steps=0 ({whole / GIB:.2f} GiB fp32): random init vs init.from, per rank")
        for col in ("layout", "init", "build s", "peak RSS GiB per rank", "import adds GiB (worst rank)"):
            table.add_column(col)
        for name, layout in LAYOUTS.items():
            args = [*MODEL, *layout, "steps=0"]
            random = train(args, tmp, f"{name} random", cache)
            imported = train([*args, f"init.from={tmp / 'llama-125m'}"], tmp, f"{name} hf", cache)
            added = max(b - a for a, b in zip(random["peak_mem_gib_per_rank"], imported["peak_mem_gib_per_rank"]))
            for label, s in (("random", random), ("init.from", imported)):
                table.add_row(
                    name,
                    label,
                    f"{s['build_time_s']:.1f}",
                    ranks_text(s["peak_mem_gib_per_rank"]),
                    f"{added:+.2f}" if s is imported else "",
                )
        console.print(table)
