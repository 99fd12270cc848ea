"""Installs that work outside the checkout: a wheel (the configs ship inside the package, and a user's own
YAML is found from their directory with `--config-dir`), and an offline install from `make wheelhouse`
beside a torch that is already there, with only the minimal dependencies."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from launcher.config.schema import CONF_DIR
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

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


def fresh_venv(where: Path, packages: Path) -> Path:
    """A venv without the launcher that sees the packages in `packages` through a path entry, not through
    their .pth files (so the editable install of this checkout stays invisible)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text(f"{packages}\n")
    return python


def torch_only(site: Path) -> Path:
    """Links to torch and the packages it needs, nothing else: what a GPU node's own image provides."""
    site.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop().lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
        todo += [re.split(r"[<>=!~;\[ ]", r)[0] for r in dist.requires or [] if "extra ==" not in r]
    return site


def pip_into(python: Path, *args: str) -> None:
    """This environment's pip, installing into another interpreter's environment."""
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *args], check=True)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (--no-deps, --no-index): its bin folder."""
    tmp = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp / "wheels")
    python = fresh_venv(tmp / "venv", Path(sysconfig.get_paths()["purelib"]))
    pip_into(python, "--no-deps", "--no-index", str(wheel))
    return python.parent


def run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LAUNCHER_OUTPUTS": str(cwd / "outputs")}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, env=env)


def quick(tmp: Path) -> list[str]:
    """A seconds-long `tiny` run on a small slice of the embedded corpus."""
    run_args = ["+model=tiny", "steps=2", "seq_len=32", "batch.micro=2", "eval.every=0", "metrics.console=plain"]
    return [*run_args, "data.max_bytes=100000", f"data.cache_dir={tmp / 'cache'}", f"run_dir={tmp / 'run'}"]


def test_the_wheel_imports_the_installed_package_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    result = run(installed, "python", "-c", "import launcher.config.schema as c; print(c.CONF_DIR)", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    conf = Path(result.stdout.strip())
    assert conf.is_relative_to(installed.parent) and (conf / "model" / "small.yaml").is_file(), conf


def test_train_and_plan_run_from_an_empty_directory(installed: Path, tmp_path: Path) -> None:
    result = run(installed, "train", *quick(tmp_path), "metrics.wandb.mode=disabled", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()
    result = run(installed, "plan", "+model=8b", "nodes=1", "plan.top=1", cwd=tmp_path)
    assert result.returncode == 0 and "layouts fit" in result.stdout, result.stderr[-2000:]
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


def test_offline_install_from_the_wheelhouse_beside_an_existing_torch(tmp_path: Path) -> None:
    """`make wheelhouse` (the minimal dependencies), then `pip install --no-index --find-links wheelhouse -e .`
    into a venv that has torch and nothing else: doctor passes, `train` and `plan` run."""
    wheelhouse = tmp_path / "wheelhouse"
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), f"--out={wheelhouse}", "--extras=none"],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert not list(wheelhouse.glob("torch-*")) and list(wheelhouse.glob("hydra_core-*.whl"))
    python = fresh_venv(tmp_path / "venv", torch_only(tmp_path / "node-site"))
    assert run(python.parent, "python", "-c", "import hydra", cwd=tmp_path).returncode != 0  # nothing but torch
    pip_into(python, "--no-index", "--find-links", str(wheelhouse), "-e", str(ROOT))
    bin_dir = python.parent
    doctor = run(bin_dir, "doctor", f"cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "warning  extras         missing fp8, ft, hf, plot, slurm, text, wandb" in doctor.stdout
    trained = run(bin_dir, "train", *quick(tmp_path), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "note: wandb is not installed, metrics go to metrics.jsonl only (pip install 'launcher[wandb]')" in (
        trained.stdout
    )
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and not (tmp_path / "run" / "wandb").exists()
    assert "note: no loss curve without matplotlib (pip install 'launcher[plot]')" in trained.stdout
    assert not (tmp_path / "run" / "loss.png").exists()
    planned = run(bin_dir, "plan", "+model=8b", "nodes=1", "plan.top=1", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-2000:]
    for args, line in MISSING_EXTRAS:
        refused = run(bin_dir, *args, cwd=tmp_path)
        assert (refused.returncode, refused.stderr.strip()) == (2, f"error: {line}"), refused.stderr[-2000:]


MISSING_EXTRAS = [  # a feature used without its extra: one line naming the install, before any worker starts
    (
        ["train", "metrics.wandb.mode=online"],
        "metrics.wandb.mode=online needs the wandb package: pip install 'launcher[wandb]'",
    ),
    (
        ["train", "data=text", "data.path=c.jsonl", "data.tokenizer=t.json"],
        "data=text needs the datasets package: pip install 'launcher[text]'",
    ),
    (
        ["export-weights", "ckpt", "out.safetensors"],
        "export-weights needs the safetensors package: pip install 'launcher[hf]'",
    ),
    (
        ["train", "-m", "hydra/launcher=slurm", "+model=tiny"],
        "hydra/launcher=slurm needs the hydra_submitit_launcher package: pip install 'launcher[slurm]'",
    ),
]
