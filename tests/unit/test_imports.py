"""The `launcher` package's import graph has no circle and no arrow back up its rooms' order, and the light
entry points stay light: a worker's imports load no planner, `plan` and submission no torch. `bench`'s
graph has no circle either.

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

# The rooms from the bottom up (docs/architecture.md, "Rooms"): a module imports its own room or one below.
# A module belongs to the longest name here that it starts with.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("launcher.errors", "launcher.files", "launcher.flops"),  # the shared leaves
    ("launcher.compat",),
    ("launcher.layout",),  # the model's shape it reads is flops' ModelShape: no config
    ("launcher.config",),  # the schema, the checks, and the seam a worker receives (its Layout, prediction)
    ("launcher.charts",),  # over config: matplotlib's install hint is config/extras.py's
    ("launcher.ops",),
    ("launcher.data",),  # token streams need no model
    ("launcher.metrics",),  # figures and sinks need no model: the runner, the MoE table come as plain values
    ("launcher.model",),
    ("launcher.parallel",),
    ("launcher.train",),
    ("launcher.hardware",),  # its probes run real blocks (model, parallel, train's allocator)
    ("launcher.planner",),
    ("launcher.simulate",),  # the runtime on fake tensors beside the planner's figures
    ("launcher.launch",),
)


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
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


def graph_of(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_no_import_circle() -> None:
    graph = graph_of()
    assert len(graph) > 40 and graph["launcher.launch.cli"], "the graph is built from the whole package"
    found = cycle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_no_import_circle_in_bench() -> None:
    graph = graph_of(ROOT / "bench")
    assert len(graph) > 20 and graph["bench.gpu_check"], "the graph is built from the whole of bench/"
    found = cycle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def room_of(module: str) -> tuple[int, str]:
    """The layer of `module` (its index in LAYERS) and the name in LAYERS it belongs to."""
    found = [
        (len(n), i, n) for i, names in enumerate(LAYERS) for n in names if module == n or module.startswith(n + ".")
    ]
    assert found, f"{module} is in no room of LAYERS: add it where its imports put it (docs/architecture.md too)"
    _, layer, name = max(found)
    return layer, name


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a room to one above it, as lines for people."""
    found = []
    for module in sorted(graph):
        layer, own = room_of(module)
        for target in sorted(graph[module]):
            above, room = room_of(target)
            if above > layer:
                found.append(f"{module} -> {target} ({room} sits above {own})")
    return found


def test_no_arrow_back_up() -> None:
    """Every import, a lazy or an annotation-only one too, goes to the module's own room or one below."""
    graph = {name: targets for name, targets in graph_of().items() if name != "launcher"}  # the root: a docstring
    found = arrows_back_up(graph)
    assert not found, "imports up the rooms' order (tests/unit/test_imports.py LAYERS):\n" + "\n".join(found)


def test_the_order_check_finds_an_arrow_back_up() -> None:
    graph = {"launcher.metrics.sources": {"launcher.parallel.runner", "launcher.data.mix", "launcher.config.run"}}
    assert arrows_back_up(graph) == [
        "launcher.metrics.sources -> launcher.parallel.runner (launcher.parallel sits above launcher.metrics)"
    ]
    assert (
        room_of("launcher.layout.rules")[0] < room_of("launcher.config.schema")[0] == room_of("launcher.config.run")[0]
    )


def test_a_worker_loads_no_planner() -> None:
    """What every rank imports (its Run, the loop) loads neither the planner nor the calibration: a worker
    receives the prediction as a plain value (launcher/config/prediction.py)."""
    code = (
        "import sys, launcher.config.run, launcher.train.loop\n"
        "up = sorted(m for m in sys.modules if m.startswith(('launcher.planner', 'launcher.hardware.probes')))\n"
        "assert not up, f'a worker loaded {up}'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_entry_points_and_submission_side_do_not_import_torch() -> None:
    """`plan` and SLURM submission stay light: the CLI, compat/, slurm*.py and the metrics sinks
    import torch only when used."""
    code = (
        "import sys, launcher.launch.cli, launcher.compat.torch_compat, launcher.compat.hydra_compat\n"
        "import launcher.launch.slurm, launcher.launch.slurm_job\n"
        "import launcher.metrics.sinks\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
