#!/usr/bin/env bash
# The CUDA checks, in one short run on a machine with an NVIDIA GPU and PyTorch (for instance
# the device tool's machine, which has no network and no tiercache installed):
#   1. the tests whose CUDA variants skip on CPU machines (GPU tier, pinned CPU tier, the CUDA
#      copy handler and its streams, KV layouts on a CUDA engine buffer, hashing of CUDA tensors);
#   2. bench/bench_transfer.py on CUDA: engine buffer on the GPU <-> pinned CPU tier, against
#      pinned cudaMemcpy in the same run, with one allocation and with vLLM's 32-layer layout,
#      each copy mode side by side (MODES: the one-launch kernel direct and staged, by layers);
#   3. bench/test_micro.py's GPU tier round trip;
#   4. the whole main suite with CUDA present (CPU tiers are pinned then), time-boxed, on 8
#      workers where pytest-xdist is installed (benchmarks then only run once, untimed).
# Logs go to $OUT (default /tmp/device-check). Wheels in .whl/ (lmdb, zstandard, redis for
# Python 3.12; bench/device_wheels.sh downloads them) are installed first when present;
# tiercache runs from this tree, uninstalled. Exits non-zero when any step fails (a test, a
# bench that raised, a step past its time box).
# Run from the repository root: bash bench/device_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/device-check}
PY=${PY:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
# pyproject maps tiers/ and policies/ into the package; without an install, links do.
[ -e tiercache/tiers ] || ln -s ../tiers tiercache/tiers
[ -e tiercache/policies ] || ln -s ../policies tiercache/policies
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
pytest_q=(-m pytest -q -p no:cacheprovider -rs)
steps=" ${STEPS:-info tests bench micro suite} "  # a subset, e.g. STEPS="info suite"
step() { [[ "$steps" == *" $1 "* ]]; }
status=0
failed() {  # STEP RC: remember the first failure, say which step
    echo "device_check: step $1 failed (status $2)" >&2
    [ "$status" -eq 0 ] && status=$2
}

if step info; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
fi 2>&1 | tee "$OUT/gpu.txt"

if step tests; then
    timeout "${TESTS_S:-150}" $PY "${pytest_q[@]}" tests/test_tiers_pool.py \
        tests/test_transfer_*.py tests/test_hashing.py tests/test_cache.py 2>&1 \
        | tee "$OUT/cuda_tests.log" | tail -25
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed tests "$rc"
fi

if step bench; then
    for layers in 1 32; do
        timeout "${BENCH_S:-120}" $PY bench/bench_transfer.py --device "${DEVICE:-cuda}" \
            --runs "${RUNS:-7}" --small-jobs 1000 --layers "$layers" \
            --modes "${MODES:-direct,staged,layers}" 2>&1 || echo "bench_transfer --layers $layers: status $?"
    done | tee "$OUT/bench_transfer.log"
    grep -q "bench_transfer --layers .*: status" "$OUT/bench_transfer.log" && failed bench 1
    # The worker's Python path alone per one-block job (a copy that does nothing).
    timeout 60 $PY bench/bench_transfer.py --host-path --runs 5 --small-jobs 2000 2>&1 \
        | tee -a "$OUT/bench_transfer.log" || failed host-path $?
    # Host-side time of a one-block job of 32 layers (Python, thread hand-offs, launches).
    timeout 60 $PY bench/bench_transfer.py --device "${DEVICE:-cuda}" --runs 1 --blocks 16 \
        --small-jobs 500 --layers 32 --modes auto --profile >"$OUT/profile.log" 2>&1 \
        || failed profile $?
fi

if step micro; then
    timeout 60 $PY "${pytest_q[@]}" bench/test_micro.py -k "gpu_tier or cpu_copy_baseline" \
        --benchmark-columns=median,ops --benchmark-sort=name 2>&1 | tee "$OUT/micro.log" | tail -15
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed micro "$rc"
fi

# A test past 60 s dumps every thread's stack (and, with pytest-timeout, ends the run): a hang
# names its test and where it waits instead of eating the time box. SUITE_ARGS: more options.
if step suite; then
    per_test=(-o faulthandler_timeout=60)
    $PY -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=60 --timeout-method=thread)
    # Serially the suite outlasts its box there (16 cores idle); with pytest-xdist, one
    # worker a file (a file's tests share fixtures and ports): 90 s on the H200 machine.
    $PY -c "import xdist" 2>/dev/null && per_test+=(-n "${SUITE_WORKERS:-8}" --dist loadfile)
    # shellcheck disable=SC2086
    timeout "${SUITE_S:-200}" $PY -m pytest -v -p no:cacheprovider -rs --ignore=tests/vllm \
        --durations=25 "${per_test[@]}" ${SUITE_ARGS:-} 2>&1 | tee "$OUT/suite.log" | tail -30
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed suite "$rc"
fi
exit "$status"
