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
# exactly these two minors and those between (tests/unit/test_torch_range.py checks that they agree)
VERSIONS=(2.11.0 2.15.0)

# The subset: every private-API check, every block kind compiled (one graph each, tests/unit/test_compile.py),
# then one run of each parallelism against one process (the module fixtures run only the cases selected
# here), DCP save / resume / reshard, the CUDA path's
# FSDP bf16 policy and fused AdamW (MoE experts in units of one rank too); tied embeddings over four stages (their pair groups); a failed save
# (DCP's errors), a spike rolled back under tp=2, the watchdog (faulthandler, the flight recorder's
# private dump); torchao's float8 training under FSDP's float8 all-gather, resumed as bf16 under tp=2;
# FlexAttention's document mask and the document ids handed to pipeline stages. About 3 minutes a version.
TESTS=(
    tests/unit/test_compat.py
    tests/unit/test_cuda_path.py
    tests/unit/test_moe_cuda_path.py
    tests/unit/test_compile.py
    "tests/integration/test_parallel.py::test_matches_single_process[tp2-sp-pre-rmsnorm]"
    "tests/integration/test_parallel.py::test_matches_single_process[pp2-interleaved-pre-rmsnorm]"
    "tests/integration/test_parallel.py::test_matches_single_process[dp2-ddp-post-layernorm]"
    "tests/integration/test_parallel.py::test_matches_single_process[pp2-1f1b-post-layernorm]"
    "tests/unit/test_context.py::test_matches_single_process[cp2-pre-rmsnorm]"
    "tests/unit/test_schedules.py::test_zero_bubble_schedules_match_single_process[pp2]"
    "tests/integration/test_moe_parallel.py::test_expert_parallel_matches_one_process[ep2]"
    "tests/unit/test_tied_pipeline.py::test_tied_pipeline_matches_one_process[pp4]"
    tests/unit/test_checkpoint.py::test_resume_is_exact
    "tests/integration/test_reshard.py::test_checkpoint_reshards_across_layouts[cp2-to-single]"
    tests/unit/test_checkpoint_writes.py::test_failed_save_is_one_line_training_goes_on_and_resumes_exactly
    "tests/integration/test_spike.py::test_rollback_trains_on_as_a_run_that_never_saw_those_batches[2]"
    tests/unit/test_watchdog.py::test_flight_recorder_trace_is_a_pickle_of_this_process
    tests/unit/test_watchdog.py::test_a_stopped_worker_is_named_with_its_phase_and_the_run_exits_hung
    "tests/integration/test_fp8.py::test_fp8_checkpoint_resumes_as_bf16_and_as_fp8_under_another_layout[dtype=fp8 dp=2 dp_shard=2-dtype=bf16 tp=2]"
    tests/unit/test_document_mask.py::test_flex_block_mask_matches_the_dense_mask
    "tests/unit/test_document_mask.py::test_parallel_packed_batch_equals_each_document_alone[pp2]"
)

CACHE="${COMPAT_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/launcher/compat}"
PY="${PY:-python3}"

# the venv of torch $1 under $CACHE, created or brought up to date (a subshell: the lock ends with it)
prepare() (
    dir="$CACHE/torch-$1"
    want="$(sha256sum pyproject.toml | cut -c1-16) $PWD"
    exec 9>"$dir.lock" && flock 9 # one pip at a time in a venv, whichever checkout runs it
    [[ -x $dir/bin/python && "$(cat "$dir/.installed" 2>/dev/null)" == "$want" ]] && exit 0
    [[ -x $dir/bin/python ]] || { "$PY" -m venv "$dir" && "$dir/bin/pip" install -q --upgrade pip; }
    echo "torch==$1" >"$dir/.pins" # exactly this torch, whatever the machine's pip configuration caps it at
    PIP_CONSTRAINT="$dir/.pins" "$dir/bin/pip" install -q "torch==$1" -e '.[dev,hf,fp8]'
    echo "$want" >"$dir/.installed"
)

# in the background, its output in $CACHE/torch-$1.log: the next version downloads while one is tested
declare -A preparing
start_preparing() { prepare "$1" >"$CACHE/torch-$1.log" 2>&1 & preparing[$1]=$!; }

(($#)) && VERSIONS=("$@")
mkdir -p "$CACHE"
failed=()
start_preparing "${VERSIONS[0]}"
for i in "${!VERSIONS[@]}"; do
    version=${VERSIONS[$i]}
    if ! wait "${preparing[$version]}"; then
        tail -n 20 "$CACHE/torch-$version.log"
        echo "== torch $version: FAILED to install after $SECONDS s (log: $CACHE/torch-$version.log)"
        failed+=("$version")
        continue
    fi
    ((i + 1 < ${#VERSIONS[@]})) && start_preparing "${VERSIONS[$((i + 1))]}"
    echo "== torch $version: venv $CACHE/torch-$version ready at $SECONDS s"
    began=$SECONDS
    if "$CACHE/torch-$version/bin/python" -m pytest -q -n 2 --dist loadfile "${TESTS[@]}"; then
        echo "== torch $version: passed in $((SECONDS - began)) s"
    else
        echo "== torch $version: FAILED after $((SECONDS - began)) s"
        failed+=("$version")
    fi
done
echo "== make test-compat: $SECONDS s"
[[ ${#failed[@]} -eq 0 ]] || { echo "torch ${failed[*]}: failed"; exit 1; }
