"""The `launcher` package's import graph has no circle, and the light entry points stay light.

Every import counts, function-local ones too (a lazy import still ties the two modules together),
and so does the package an import runs on the way (`import a.b.c` runs a/__init__ and a/b/__init__),
except the importing module's own packages, which are already being imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "launcher"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            if module in modules and module != name and not name.startswith(module + "."):
                found.add(module)
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle() -> None:
    modules = module_names()
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["launcher.launch.cli"], "the graph is built from the whole package"
    found = cycle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_entry_points_and_submission_side_do_not_import_torch() -> None:
    """`plan` and SLURM submission stay light: the CLI, compat/, slurm*.py and the metrics sinks
    import torch only when used."""
    code = (
        "import sys, launcher.launch.cli, launcher.compat.torch_api, launcher.compat.hydra_api\n"
        "import launcher.launch.slurm, launcher.launch.slurm_job\n"
        "import launcher.metrics.sinks\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
