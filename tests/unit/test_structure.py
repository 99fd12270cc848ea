"""The package's shape: modules a reader can hold in their head, functions that fit a screen, and one
seam between the configuration and the runtime (DESIGN.md: "Conventions", and the seam at the end of
"Layout of the repository").

Read from the source with `ast` alone (no launcher or torch import), so these run in a blink.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from tests.unit.test_imports import module_names

MODULE_LINES = 350
FUNCTION_LINES = 60

# The modules that may name `TrainConfig`: the entry points (`launch/cli.py`), the launchers (`spawn` and the
# SLURM and sweep submission beside it), the planner's `resolve` and the request it reads, and the config room's
# schema and checks (CONFIG_HOMES; `run.py`, `options.py` and `precision.py` there take what they read, not it).
# Everything below them receives a `Layout`, a `Prediction` and a `BuildOptions`.
MAY_READ_TRAIN_CONFIG = {
    "launcher.launch.cli",
    "launcher.launch.spawn",
    "launcher.launch.slurm",
    "launcher.launch.sweep",
    "launcher.planner",
    "launcher.planner.request",
}
CONFIG_HOMES = (
    "launcher.config.schema",
    "launcher.config.validate",
    "launcher.config.feature_keys",
    "launcher.config.layout_keys",
)  # schema, checks, the keys read into a Layout


@cache
def trees() -> tuple[tuple[str, Path, ast.Module], ...]:
    return tuple(
        (name, path, ast.parse(path.read_text(), filename=str(path))) for name, path in sorted(module_names().items())
    )


def too_long_functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, lines) of each function or method, nested ones too, longer than FUNCTION_LINES.

    A function's lines run from its `def` to its last line: the docstring counts, decorators do not."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                size = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and size > FUNCTION_LINES:
                    found.append((name, size))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_every_module_fits_in_a_readers_head() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in module_names().items()}
    assert len(sizes) > 40, "measured over the whole package"
    over = [f"{name}: {lines} lines" for name, lines in sorted(sizes.items()) if lines > MODULE_LINES]
    assert not over, f"modules longer than {MODULE_LINES} lines (split by concept):\n" + "\n".join(over)


def test_every_function_fits_on_a_screen() -> None:
    over = [f"{name}.{func}: {lines} lines" for name, _, tree in trees() for func, lines in too_long_functions(tree)]
    assert not over, f"functions longer than {FUNCTION_LINES} lines (def to last line):\n" + "\n".join(over)


def test_the_function_measure_counts_def_to_end_without_decorators() -> None:
    def body(lines: int, indent: str) -> str:
        return "".join(f"{indent}x = 1\n" for _ in range(lines))

    fits = "@decorator\n@decorator\ndef fits():\n" + body(FUNCTION_LINES - 1, "    ")
    too_long = "class C:\n    def long(self):\n" + body(FUNCTION_LINES, "        ")
    assert too_long_functions(ast.parse(fits + too_long)) == [("C.long", FUNCTION_LINES + 1)]


def names_train_config(tree: ast.AST) -> bool:
    """Whether a module imports `TrainConfig`, reads it off a module (`config.TrainConfig`), or names it
    in code, in an annotation or in a string annotation."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "TrainConfig" for alias in node.names):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "TrainConfig":
            return True
        if isinstance(node, ast.Name) and node.id == "TrainConfig":
            return True
        for note in annotations(node):
            if isinstance(note, ast.Constant) and isinstance(note.value, str):
                if names_train_config(ast.parse(note.value, mode="eval")):
                    return True
    return False


def annotations(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
        return [node.annotation]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
        return [node.returns]
    return []


def config_home(name: str, tree: ast.Module) -> bool:
    defines = any(isinstance(node, ast.ClassDef) and node.name == "TrainConfig" for node in tree.body)
    return defines or any(name == home or name.startswith(home + ".") for home in CONFIG_HOMES)


def test_only_the_entry_points_read_train_config() -> None:
    readers = {name: tree for name, _, tree in trees() if names_train_config(tree)}
    assert "launcher.launch.cli" in readers, "the detector sees the entry points read it"
    below = sorted(name for name, tree in readers.items() if name not in MAY_READ_TRAIN_CONFIG)
    below = [name for name in below if not config_home(name, readers[name])]
    assert not below, (
        "only cli, spawn, slurm, sweep, the planner's resolve (launcher.planner, launcher.planner.request) and "
        "the config/validation modules (and layout_config, which reads the layout keys) may import TrainConfig; "
        "everything below them takes a Layout, a "
        "Prediction and a BuildOptions. Reading it here:\n" + "\n".join(below)
    )


def test_the_seam_detector_sees_each_way_of_naming_it() -> None:
    for source in (
        "from launcher.config.schema import TrainConfig",
        "from .config import LauncherError, TrainConfig as T",
        "import launcher.config.schema as c\nx: c.TrainConfig",
        "def f(cfg: 'TrainConfig') -> None: ...",
        "def f() -> 'list[TrainConfig]': ...",
    ):
        assert names_train_config(ast.parse(source)), source
    assert not names_train_config(
        ast.parse("from launcher.config.schema import ModelConfig\n'TrainConfig in a docstring'")
    )
