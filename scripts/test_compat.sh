#!/usr/bin/env bash
# `make test-compat`: the compat, parallel-equivalence, checkpoint and CUDA-path tests under each end of
# the torch range that pyproject.toml states (the whole suite runs on the pinned torch: `make test`).
#
#   scripts/test_compat.sh [VERSION ...]        default: the versions below
#
# Each version has its own venv, kept between runs (and shared by every checkout on this machine) under
# $COMPAT_VENVS, default ~/.cache/launcher/compat: the registry's CUDA build with its nvidia-* libraries,
# ~3 GB, a few minutes to download the first time; it runs on a CPU. A venv is reinstalled when
# pyproject.toml or the checkout it serves changes. Exit 1 if any version fails.
set -euo pipefail
cd "$(dirname "$0")/.."

# the oldest torch the package admits, the newest the registry serves: pyproject.toml's range is
# exactly these two minors and those between (tests/test_install.py checks that they agree)
VERSIONS=(2.11.0 2.15.0)

# The subset: every private-API check, then one run of each parallelism against one process (the
# module fixtures run only the cases selected here), DCP save / resume / reshard, the CUDA path's
# FSDP bf16 policy and fused AdamW. About 2 minutes a version on 2 cores.
TESTS=(
    tests/test_compat.py
    tests/test_cuda_path.py
    "tests/test_parallel.py::test_matches_single_process[tp2-sp-pre-rmsnorm]"
    "tests/test_parallel.py::test_matches_single_process[pp2-interleaved-pre-rmsnorm]"
    "tests/test_parallel.py::test_matches_single_process[dp2-ddp-post-layernorm]"
    "tests/test_parallel.py::test_matches_single_process[pp2-1f1b-post-layernorm]"
    "tests/test_context.py::test_matches_single_process[cp2-pre-rmsnorm]"
    "tests/test_schedules.py::test_zero_bubble_schedules_match_single_process[pp2]"
    "tests/test_moe_parallel.py::test_expert_parallel_matches_one_process[ep2]"
    tests/test_checkpoint.py::test_resume_is_exact
    "tests/test_reshard.py::test_checkpoint_reshards_across_layouts[cp2-to-single]"
)

CACHE="${COMPAT_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/launcher/compat}"
PY="${PY:-python3}"

# the venv of torch $1 under $CACHE, created or brought up to date
prepare() {
    local dir="$CACHE/torch-$1" want pins
    want="$(sha256sum pyproject.toml | cut -c1-16) $PWD"
    [[ -x $dir/bin/python ]] || { $PY -m venv "$dir" && "$dir/bin/pip" install -q --upgrade pip; }
    [[ "$(cat "$dir/.installed" 2>/dev/null)" == "$want" ]] && return
    # exactly this torch, whatever else the machine's pip configuration caps it at
    pins="$dir/.pins" && echo "torch==$1" >"$pins"
    PIP_CONSTRAINT="$pins" "$dir/bin/pip" install -q "torch==$1" -e '.[dev,hf]'
    echo "$want" >"$dir/.installed"
}

(($#)) && VERSIONS=("$@")
mkdir -p "$CACHE"
failed=()
for version in "${VERSIONS[@]}"; do
    start=$SECONDS
    exec {lock}>"$CACHE/torch-$version.lock" && flock "$lock"  # one checkout at a time per venv
    echo "== torch $version: venv $CACHE/torch-$version"
    if prepare "$version" && echo "== torch $version: ready after $((SECONDS - start)) s" &&
        "$CACHE/torch-$version/bin/python" -m pytest -q "${TESTS[@]}"; then
        echo "== torch $version: passed in $((SECONDS - start)) s"
    else
        echo "== torch $version: FAILED after $((SECONDS - start)) s"
        failed+=("$version")
    fi
    exec {lock}>&-
done
[[ ${#failed[@]} -eq 0 ]] || { echo "torch ${failed[*]}: failed"; exit 1; }
