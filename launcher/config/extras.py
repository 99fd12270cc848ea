"""Optional dependencies: which `pip install 'launcher[EXTRA]'` provides a feature, and the one line said
when it is missing. A minimal install (torch, hydra-core, omegaconf, rich, numpy) trains and plans;
everything else is imported only where it is used."""

from __future__ import annotations

import importlib.util

from launcher.errors import LauncherError

EXTRAS = {  # module → the extra that installs it (pyproject.toml [project.optional-dependencies])
    "wandb": "wandb",
    "datasets": "text",
    "tokenizers": "text",
    "safetensors": "hf",
    "transformers": "hf",
    "submitit": "slurm",
    "hydra_plugins.hydra_submitit_launcher": "slurm",
    "matplotlib": "plot",
    "torchao": "fp8",
    "torchft": "ft",
}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package (hydra_plugins.X)
        return False


def install_hint(module: str) -> str:
    return f"pip install 'launcher[{EXTRAS[module]}]'"


def require(*modules: str, what: str) -> None:
    """`what` (a feature, as the user named it) needs these modules: one LauncherError naming the first missing."""
    for module in modules:
        if not installed(module):
            raise LauncherError(f"{what} needs the {module.rpartition('.')[2]} package: {install_hint(module)}")
