"""`python scripts/wheelhouse.py --python-version=3.12` (or `make wheelhouse ARGS=...`): every dependency
of the launcher except torch, as wheels for one Python version and platform, in one folder, so a
cluster node without internet installs the launcher beside its own torch:

    pip install --no-index --find-links wheelhouse -e '.[fp8]'          # from the source tree
    pip install --no-index --find-links wheelhouse 'launcher[fp8]'      # or the launcher's wheel, in the folder too

The default extras are what `gpu-check` needs (fp8: torchao), 22 MiB for Python 3.12 on Linux x86-64,
small enough to carry to a node with the source tree; `--extras=all` adds wandb, datasets, transformers,
submitit and matplotlib (over 100 MiB: pyarrow alone is 52).

Only the standard library and pip. Packages published only as source (antlr4-python3-runtime, which
hydra-core needs) are built into pure-Python wheels here first, then pip downloads the rest for the
target with `--only-binary=:all:`, taking those from the folder.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ["setuptools>=68", "wheel"]  # the build backend, for `pip install --no-index -e .`
DEFAULT_EXTRAS = "fp8"  # what bench/gpu_check.py runs: torchao for its fp8 row
LINUX = ["manylinux1_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def checked(result: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if result.returncode:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or [result.stderr[-600:]]
        raise SystemExit(f"wheelhouse: {what} failed: {' '.join(errors)}")
    return result


def own_wheel(out: Path) -> Path:
    checked(pip("wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)), "building the launcher's wheel")
    return max(out.glob("launcher-*.whl"), key=lambda p: p.stat().st_mtime)


def requirements(wheel: Path, extras: set[str]) -> list[str]:
    """The wheel's Requires-Dist for these extras (and the ones they name), without torch."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs: list[str] = []
    pending, seen = set(extras), set()
    while pending:
        extra = pending.pop()
        seen.add(extra)
        for line in meta.splitlines():
            if not line.startswith("Requires-Dist: "):
                continue
            spec, _, marker = line.removeprefix("Requires-Dist: ").partition(";")
            wanted = re.search(r'extra == "([^"]+)"', marker)
            if (wanted.group(1) if wanted else "") != extra:
                continue
            if spec.startswith("launcher["):  # `all`: other extras of ours
                pending |= set(re.findall(r"[\w-]+", spec.split("[")[1])) - seen
            elif re.split(r"[<>=!~\[ ]", spec)[0].lower() != "torch":
                reqs.append(spec.strip())
    return sorted(set(reqs))


def source_only(reqs: list[str]) -> list[str]:
    """`name==version` of the packages that resolve to a source archive (resolved for this Python)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        args = ["install", "-q", "--dry-run", "--ignore-installed", "--report", str(report), *reqs]
        checked(pip(*args), "resolving the requirements")
        items = json.loads(report.read_text())["install"]
    return [
        f"{i['metadata']['name']}=={i['metadata']['version']}"
        for i in items
        if not i["download_info"]["url"].endswith(".whl")
    ]


def build(out: Path, python_version: str, platforms: list[str], extras: set[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    wheel = own_wheel(out)
    reqs = [*requirements(wheel, extras), *BUILD]
    for spec in source_only(reqs):
        checked(pip("wheel", "-q", "--no-deps", spec, "-w", str(out)), f"building a wheel of {spec}")
    target = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    target += [f"--platform={p}" for p in platforms]
    checked(pip("download", "-q", *target, "--find-links", str(out), "-d", str(out), *reqs), "downloading")
    return sorted(out.glob("*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="wheelhouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="wheelhouse", help="the folder (default: wheelhouse)")
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--platform", action="append", help="pip platform tags (default: Linux x86-64 manylinux)")
    parser.add_argument(
        "--extras",
        default=DEFAULT_EXTRAS,
        help=f"comma-separated extras (default {DEFAULT_EXTRAS}: gpu-check's; all; none)",
    )
    args = parser.parse_args()
    extras = {""} | ({e for e in args.extras.split(",") if e} - {"none"})
    wheels = build(Path(args.out).resolve(), args.python_version, args.platform or LINUX, extras)
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"wheelhouse: {len(wheels)} wheels ({size:.0f} MiB) in {args.out} for Python {args.python_version}")
    named = ",".join(sorted(extras - {""}))
    print(
        f"install beside the node's torch: pip install --no-index --find-links {args.out} -e '.[{named}]'"
        if named
        else f"install beside the node's torch: pip install --no-index --find-links {args.out} -e ."
    )


if __name__ == "__main__":
    main()
