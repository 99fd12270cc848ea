"""Where step metrics go besides the console: metrics.jsonl, summary.json and wandb."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from launcher.config import WandbConfig


class JsonlSink:
    """One JSON object per logged step, flushed each line so a crash loses nothing logged."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def log(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


class WandbSink:
    """wandb, offline by default. The API key stays in the environment: nothing here writes it."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            mode=cfg.mode,
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
        )

    def log(self, row: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file. The temporary name is this process's own, as
    several ranks may write the same file at once (each SLURM task writes prediction.json)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
