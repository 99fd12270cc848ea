"""An installed wheel works outside the checkout: the configs ship inside the package, and a user's own
YAML (a model, a hardware profile) is found from their directory with `--config-dir`."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from launcher.config import CONF_DIR
from tests.conftest import ROOT

MY_MODEL = """name: mine
dim: 64
n_layers: 2
n_heads: 4
n_kv_heads: 2
ffn_dim: 128
vocab_size: 256
max_seq_len: 1024
"""


def build_wheel(out: Path) -> Path:
    """The launcher's wheel, as a package index or an offline wheelhouse would hold it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("launcher-*.whl")
    return wheel


def fresh_venv(where: Path) -> Path:
    """A venv without the launcher that sees this environment's other packages (torch, hydra, ...) through a
    path entry, not through its .pth files: the editable install of this checkout stays invisible."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (--no-deps, --no-index): its bin folder."""
    tmp = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp / "wheels")
    python = fresh_venv(tmp / "venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    return python.parent


def run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LAUNCHER_OUTPUTS": str(cwd / "outputs")}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, env=env)


def test_the_wheel_imports_the_installed_package_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    result = run(installed, "python", "-c", "import launcher.config as c; print(c.CONF_DIR)", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    conf = Path(result.stdout.strip())
    assert conf.is_relative_to(installed.parent) and (conf / "model" / "small.yaml").is_file(), conf


def test_train_and_plan_run_from_an_empty_directory(installed: Path, tmp_path: Path) -> None:
    quick = ["+model=tiny", "steps=2", "seq_len=32", "batch.micro=2", "eval.every=0", "metrics.console=plain"]
    quick += ["metrics.wandb.mode=disabled", "data.max_bytes=100000", f"data.cache_dir={tmp_path / 'cache'}"]
    result = run(installed, "train", *quick, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()
    result = run(installed, "plan", "+model=8b", "nodes=1", "plan.top=1", cwd=tmp_path)
    assert result.returncode == 0 and "tp" in result.stdout, result.stderr[-2000:]
    result = run(installed, "export-weights", "--help", cwd=tmp_path)
    assert result.returncode == 0 and "format=hf" in result.stdout, result.stderr


def test_a_users_own_model_and_hardware_from_their_directory(installed: Path, tmp_path: Path) -> None:
    mine = tmp_path / "myconf"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "mine.yaml").write_text(MY_MODEL)
    (mine / "hardware").mkdir()
    cpu = (Path(CONF_DIR) / "hardware" / "cpu.yaml").read_text()
    (mine / "hardware" / "mycpu.yaml").write_text(cpu.replace("name: cpu", "name: mycpu"))
    mine_args = (f"--config-dir={mine}", "+model=mine", "hardware=mycpu")
    result = run(installed, "train", *mine_args, "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "name: mine" in result.stdout and "ffn_dim: 128" in result.stdout and "name: mycpu" in result.stdout
    result = run(installed, "plan", *mine_args, "plan.top=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
