"""Every command shown in README.md and docs/*.md runs, typed into bash as written: the docs cannot rot.

Commands come from ```bash blocks. CPU training runs are shortened (`steps=2`, tiny data, appended as
further overrides); a run that needs hardware this machine lacks becomes a dry run; SLURM submissions
are covered by test_slurm.py against a real cluster; lines with placeholders (DATE, TIME, ...) are
skipped. Each command name resolves, in bash, to this project's console script, not a shell builtin.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from importlib.metadata import distribution
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, run_for, run_shell
from tests.textdata import train_bpe, write_corpus

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"\b(DATE|TIME|NAME|FILE|RUN_DIR)\b|\.\.\.")
GPU = re.compile(r"hardware=(?!cpu\b)|\+recipe=(llama|megatron)|\+model=(8b|70b|405b|1b|gpt2)")


SCRIPTS = tuple(sorted(e.name for e in distribution("launcher").entry_points if e.group == "console_scripts"))
TOOLS = "python -m launcher."  # e.g. python -m launcher.data.token_file


def doc_commands() -> list[tuple[str, str]]:
    """Every line of a ```bash block that runs one of the console scripts, or evals one's output; a command
    shown in several places once, named by its first."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                command = line.split(" #")[0].strip()
                name = command.removeprefix('eval "$(').split(" ")[0]
                if command.startswith(TOOLS):
                    name = SCRIPTS[0]  # the project's own module tools run as written too
                if name in SCRIPTS and command not in {c for _, c in found}:
                    found.append((doc.name, command))
    return found


def runnable(command: str, tmp: Path) -> str | None:
    """The command line as bash runs it, or None when another test covers it."""
    writes_script = "slurm.emit=true" in command or "slurm.dry_run=true" in command  # no submission: runs here
    if command in COVERED or PLACEHOLDER.search(command) or ("hydra/launcher=slurm" in command and not writes_script):
        return None
    args = shlex.split(command)
    if args[0] != "train" or any(a.startswith("--") for a in args):
        return command
    # shortened, with nothing switched off a user has on: evaluation (once, at the last step) and checkpoints
    quick = [
        *(["steps=2"] if "steps=0" not in args else []),  # steps=0 builds and stops: as written
        "eval.batches=1",
        "metrics.wandb.mode=disabled",
        f"data.cache_dir={tmp / 'cache'}",
        "data.max_bytes=200000",
    ]
    if writes_script:  # a GPU profile's script, written for real on this GPU-less machine (a login node's lot)
        quick = []
    elif GPU.search(command):
        quick = ["dry_run=true"]
    if "-m" not in args:
        quick.append(f"run_dir={tmp / 'run'}")
    return " ".join([command, *map(shlex.quote, quick)])


def prepare_hf(command: str, tmp: Path) -> None:
    """What README's "From and to Hugging Face" and "Sampling from a run" commands read, made as its earlier
    lines make it: a `tiny` run's checkpoints under runs/tiny, and their HF export llama-tiny."""
    if not any(needs in command for needs in ("runs/tiny/checkpoints", "init.from=llama-tiny", "generate runs/tiny")):
        return
    from launcher.train.export import export
    from launcher.train.loop import train
    from tests.conftest import tiny_config

    train(run_for(tiny_config(tmp, "steps=2", "checkpoint.every=2")), tmp / "runs" / "tiny")
    if "init.from=llama-tiny" in command:
        export(str(tmp / "runs" / "tiny" / "checkpoints"), str(tmp / "llama-tiny"), "hf")


COVERED = {  # commands another test already runs in full
    "train -m tp=1,2 pp=1,2 steps=50": "tests/integration/test_sweep.py::test_layout_sweep_tp_pp",
    "train -m tp=1,2 pp=1,2 steps=50 threads=1": (
        "tests/integration/test_sweep.py::test_layout_sweep_tp_pp (threads=1 there)"
    ),
    "train --config-dir=myconf +model=mine hardware=mycluster --cfg job": (
        "tests/integration/test_install.py::test_a_users_own_model_and_hardware_from_their_directory"
    ),
}
COMMANDS = doc_commands()


def test_docs_show_commands() -> None:
    assert len(COMMANDS) >= 15


def test_readme_is_a_front_door() -> None:
    """README.md stays short (what it is, set-up, the tour, the five commands, where to read on: at most 12 KB)
    and links every page of docs/; reference text belongs in docs/ (docs/config.md: every key)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024, (
        f"README.md is {len(readme.encode()):,} bytes: move reference text to docs/"
    )
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.slow
def test_documented_command_names_are_the_projects_scripts() -> None:
    """`export` was the shell's builtin: every name the docs type must reach our console script, and no
    script may share its name with a bash builtin, keyword or another command on PATH."""
    assert {c.removeprefix('eval "$(').split(" ")[0] for _, c in COMMANDS if not c.startswith(TOOLS)} == set(SCRIPTS)
    for name in SCRIPTS:
        found = run_shell(f"type -a -t {name}; type -a -P {name}").stdout.split()
        assert found == ["file", str(Path(sys.executable).parent / name)], (name, found)


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_runs(doc: str, command: str, tmp_path: Path) -> None:
    line = runnable(command, tmp_path)
    if line is None:
        pytest.skip(COVERED.get(command, "placeholder path, or a SLURM submission (tests/integration/test_slurm.py)"))
    # for `data=tokens data.path=train.bin`: 2% of it (the validation split) holds a 256-token sequence
    (np.arange(16384, dtype=np.uint16) % 256).tofile(tmp_path / "train.bin")
    # corpus/ (.jsonl, .txt, .parquet), tokenizer.json and a model folder my-model/ (data=text, or a mixture's)
    if "data=text" in line or "name: text" in line:
        write_corpus(tmp_path / "corpus", max_chars=100_000)
        train_bpe(tmp_path / "tokenizer.json", vocab_size=512)
        (tmp_path / "my-model").mkdir()
        shutil.copy(tmp_path / "tokenizer.json", tmp_path / "my-model" / "tokenizer.json")
        (tmp_path / "my-model" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    prepare_hf(command, tmp_path)
    result = run_shell(line, cwd=tmp_path)
    assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    if "slurm.emit=true" in line:  # the script written, on a machine without a GPU
        assert "#SBATCH" in (tmp_path / "run" / "job.sbatch").read_text()
