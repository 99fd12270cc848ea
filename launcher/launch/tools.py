"""The commands beside `train` and `plan`, taken as `prog POSITIONAL... [KEY=VALUE ...]` by argparse (no Hydra
app of their own): `export-weights`, `generate` and `doctor`. Bad input ends as one line, exit 2, as in cli.py."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from launcher.config.extras import require
from launcher.errors import LauncherError, usage_errors_raised
from launcher.launch.cli import compose_error, exit_with


def keyed_parser(prog: str, description: str, examples: str, options: str, **positionals: str) -> Any:
    """The argparse parser of a command taken as `prog POSITIONAL... [KEY=VALUE ...]`, its help teaching
    by examples (the Hydra apps' --help does so through their help template)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, text in positionals.items():
        parser.add_argument(name, help=text)
    parser.add_argument("options", nargs="*", metavar="KEY=VALUE", help=options)
    return parser


EXPORT_HELP = (
    "The model weights of a sharded checkpoint (any layout) as one safetensors file, or as a Hugging Face\n"
    "Llama folder (format=hf). Named export-weights: a bare `export` is the shell's own builtin."
)
EXPORT_EXAMPLES = """examples:
  export-weights outputs/DATE/TIME/checkpoints model.safetensors   # the newest complete checkpoint
  export-weights runs/tiny/checkpoints llama-tiny format=hf        # a folder transformers loads
  export-weights old-run/checkpoints/step_400 m.safetensors model=tiny   # a checkpoint without its model

docs: docs/checkpoints.md and README.md ("From and to Hugging Face") in the project's repository"""
EXPORT_OPTIONS = "format=safetensors|hf, model=NAME, shard_gib=GIB (hf, 5)"
EXPORT_ARGUMENTS = {
    "checkpoint": "a step_* checkpoint folder, or a folder of them (newest is used)",
    "out": "output .safetensors file, or folder (format=hf)",
}


def export() -> None:
    """`export-weights CHECKPOINT OUT [KEY=VALUE ...]` (EXPORT_HELP)."""
    from launcher.train.export import export as write

    parser = keyed_parser("export-weights", EXPORT_HELP, EXPORT_EXAMPLES, EXPORT_OPTIONS, **EXPORT_ARGUMENTS)
    try:
        with usage_errors_raised():
            args = parser.parse_args()
        require("safetensors", what="export-weights")
        options = export_options(args.options)
        print(write(args.checkpoint, args.out, **options))
    except LauncherError as err:
        exit_with(err)


def key_values(prog: str, items: list[str], usage: str) -> dict[str, str]:
    """A command's KEY=VALUE options: each one of `usage`'s keys, given once, with a value (none dropped)."""
    options: dict[str, str] = {}
    for key, _, value in (item.partition("=") for item in items):
        why = "given twice" if key in options else "needs a value" if not value else ""
        if key not in (keys := re.findall(r"(\w+)=", usage)) or why:
            raise LauncherError(f"{prog}: {f'{key} {why}' if key in keys else f'unknown option {key!r}'}: use {usage}")
        options[key] = value
    return options


def export_options(items: list[str]) -> dict[str, Any]:
    """`key=value` options of `export-weights`: format, model (a launcher/conf/model name, for checkpoints that do not
    record their model), shard_gib (HF shard size)."""
    from launcher.config.schema import compose_config

    given = key_values("export-weights", items, "format=hf, model=NAME or shard_gib=GIB")
    options: dict[str, Any] = {"fmt": given["format"]} if "format" in given else {}
    if "model" in given:
        try:
            options["model"] = compose_config(f"+model={given['model']}").model
        except (HydraException, OmegaConfBaseException) as err:
            raise LauncherError(f"export-weights: model={given['model']}: {compose_error(err)}") from None
    if "shard_gib" in given:
        options["shard_gib"] = float(gib) if (gib := given["shard_gib"]).replace(".", "", 1).isdigit() else 0.0
        if not 0 < options["shard_gib"] < 2**20:  # GiB per file, a plain decimal: inf, nan, 0 split nothing
            raise LauncherError(f"export-weights: shard_gib={gib}: give a positive number of GiB, e.g. shard_gib=5")
        if options.get("fmt") != "hf":
            raise LauncherError("export-weights: shard_gib splits format=hf's weight files: add format=hf, or drop it")
    return options


def generate() -> None:
    """`generate RUN_DIR PROMPT [KEY=VALUE ...]`: the prompt and its continuation (launcher/train/generate.py)."""
    from launcher.train import generate as gen

    args = keyed_parser("generate", gen.HELP, gen.EXAMPLES, gen.OPTIONS, **gen.ARGUMENTS).parse_args()
    try:
        gen.generate(args.run_dir, args.prompt, args.options)
    except LauncherError as err:
        exit_with(err)


DOCTOR_HELP = (
    "Is this machine ready for a run? One line a check (ok, warning, fail): torch and its tested range, CUDA,\n"
    "cuDNN, NCCL, GPUs and driver, SDPA kernels, torch.compile, a process group, SLURM, free disk, the matmul\n"
    "rate against the hardware profile, optional extras. Exit 1 when something a run needs is missing."
)
DOCTOR_EXAMPLES = """examples:
  doctor                                  # this machine, its GPU's profile (or cpu)
  doctor hardware=h100_sxm run_dir=/scratch/runs   # the profile and the folder your runs will use
  doctor compile=true                     # also compile one block where compile=auto is off (CPU)

docs: README.md ("On a cluster without internet", "On GPUs") in the project's repository"""


def doctor() -> None:
    """`doctor [hardware=NAME] [run_dir=DIR] [cache_dir=DIR] [compile=true|false]` (DOCTOR_HELP)."""

    from launcher.config.schema import compile_enabled, compose_config
    from launcher.launch.doctor import Setting, default_hardware, run

    parser = keyed_parser("doctor", DOCTOR_HELP, DOCTOR_EXAMPLES, "hardware=, run_dir=, cache_dir=, compile=")
    try:
        with usage_errors_raised():
            options = key_values("doctor", parser.parse_args().options, "hardware=, run_dir=, cache_dir= or compile=")
        if (compiles := options.get("compile", "auto")) not in ("true", "false", "auto"):
            raise LauncherError(f"doctor: compile={compiles}: choose one of true, false, auto")
        keys = [f"hardware={options.get('hardware') or default_hardware()}", f"compile={compiles}"]
        cfg = compose_config(*keys, *([f"cache_dir={options['cache_dir']}"] if "cache_dir" in options else []))
    except (HydraException, OmegaConfBaseException) as err:
        exit_with(LauncherError(f"doctor: {compose_error(err)}"))
    except LauncherError as err:
        exit_with(err)
    run_dir = Path(options.get("run_dir") or os.environ.get("LAUNCHER_OUTPUTS", "outputs")).expanduser().resolve()
    setting = Setting(cfg.hardware, run_dir, Path(cfg.cache_dir).expanduser().resolve(), compile_enabled(cfg))
    sys.exit(run(setting))
