"""Where step metrics go besides the console: metrics.jsonl, summary.json and wandb."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher.config.schema import WandbConfig
from launcher.errors import LauncherError
from launcher.metrics.moe_load import layer_loads, load_histograms


class JsonlSink:
    """One JSON object per logged step, flushed each line so a crash loses nothing logged."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def log(self, row: dict[str, Any], records: Sequence[Mapping[str, Any]] = ()) -> None:
        """`row`; MoE layers' loads (`records`) stay out (their averages are in the row)."""
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


def import_wandb() -> Any:
    """wandb, quiet unless the user asked otherwise (its banners would break the one-line output)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    return wandb


def check_wandb_login() -> None:
    """online mode needs an API key (WANDB_API_KEY, or a .netrc entry that `wandb login` writes):
    without one, wandb.init would fail inside a worker. No prompt, and silent even under WANDB_SILENT=false:
    otherwise wandb.login asks the server for the user name, and an unreachable one can hold the CLI."""
    wandb = import_wandb()
    wandb.setup(wandb.Settings(silent=True))
    if not wandb.login(prompt=False, verify=False):
        raise LauncherError(
            "metrics.wandb.mode=online needs a W&B API key: set WANDB_API_KEY or run `wandb login`, "
            "or log locally with metrics.wandb.mode=offline (or disabled)"
        )


class WandbSink:
    """wandb, offline by default. The API key stays in the environment: nothing here writes it.

    Online, a server that does not answer within `init_timeout_s` never costs the run: it logs
    offline instead, and one warning line says how to upload it later."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any]) -> None:
        wandb = self.wandb = import_wandb()

        def init(mode: str) -> Any:
            return wandb.init(
                mode=mode,
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name,
                dir=str(run_dir),
                config=config,
                reinit="finish_previous",
                settings=wandb.Settings(init_timeout=cfg.init_timeout_s),
            )

        try:
            self.run = init(cfg.mode)
        except wandb.errors.Error as err:
            if cfg.mode != "online":
                raise
            self.run = init("offline")
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            print(
                f"warning: wandb could not start online ({reason}): logging offline instead; "
                f"upload later with `wandb sync {self.run.settings.sync_dir}`",
                file=sys.stderr,
                flush=True,
            )

    def log(self, row: dict[str, Any], records: Sequence[Mapping[str, Any]] = ()) -> None:
        """`row`'s figures, and per MoE layer (`records`: the step's loads) a histogram of tokens per expert."""
        charts = load_histograms(layer_loads(records), self.wandb)
        self.run.log({k: v for k, v in row.items() if k != "step"} | charts, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()
