#!/usr/bin/env bash
# One GPU-machine session: optionally the CUDA harness (tests/cuda/run_gpu.sh), then jax_dmattn
# built with its CUDA kernels (timed) or installed from a wheel, the `gpu` tests, the benchmark
# suites and sections of the Hopper forward's benchmark. Every step has its own time limit and
# its log under $OUT; a summary is printed last.
#   OUT=/tmp/out DIMS="64;128" TEST_S=300 WORKERS=1 SUITES="dynamic density" benchmarks/gpu_session.sh
#   OUT=$OUT HARNESS=1 TUNE=1 HARNESS_DIMS=128 WHEEL=.whl/jax_dmattn-*.whl WORKERS=12 SUITES= \
#     HOPPER="masked dispatch" benchmarks/gpu_session.sh
# WORKERS > 1 spreads the tests over pytest-xdist processes sharing the GPU (each without JAX's
# memory preallocation); the full gpu suite takes more than 5 minutes in one process. TESTS_K
# passes a -k filter; TEST_S=0 skips the tests. HARNESS_DIMS / HARNESS_DTYPES / TUNE go to
# run_gpu.sh as DIMS / DTYPES / TUNE. WHEEL installs that wheel instead of building the source
# (a wheel built elsewhere, e.g. with JAX_DMATTN_CUDA_WHEELS=13).
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$repo/build/gpu_session}
DIMS=${DIMS:-"32;64;96;128;192;256"}
SUITES=${SUITES-"dense bias_mask dynamic density packed"}
mkdir -p "$OUT"
t0=$SECONDS
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
: > "$OUT/summary.txt"

if [ "${HARNESS:-0}" = 1 ]; then
  (cd "$repo" && LOG="$OUT/harness" DIMS="${HARNESS_DIMS:-64 128 256}" \
    DTYPES="${HARNESS_DTYPES:-bf16 fp16}" TUNE="${TUNE:-0}" bash tests/cuda/run_gpu.sh) \
    > "$OUT/harness.log" 2>&1
  { echo "harness (rc=$?) at $((SECONDS - t0)) s:"; cat "$OUT/harness/summary.txt"; } \
    | tee -a "$OUT/summary.txt"
fi

if [ -n "${WHEEL:-}" ]; then
  python3 -m pip install --no-deps --target /tmp/site $WHEEL > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  echo "installed $WHEEL" | tee -a "$OUT/summary.txt"
else
  (cd "$repo" && python3 -m pip install --no-build-isolation --no-deps --target /tmp/site \
    -C cmake.define.JAX_DMATTN_CUDA=ON -C cmake.define.JAX_DMATTN_CUDA_ARCHS=90a \
    -C "cmake.define.JAX_DMATTN_HEAD_DIMS=$DIMS" .) > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build (sm_90a, head dims $DIMS, bf16+fp16, $CMAKE_BUILD_PARALLEL_LEVEL jobs):" \
    "$((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
fi

# Run from outside the repository so that the installed package, not the source tree, is imported.
cd /tmp && export PYTHONPATH=/tmp/site
python3 -P -m jax_dmattn > "$OUT/self_check.log" 2>&1
echo "python -m jax_dmattn (rc=$?): $(grep -m1 '^GPU:' "$OUT/self_check.log")" \
  | tee -a "$OUT/summary.txt"
if [ "${TEST_S:-300}" -gt 0 ]; then
  workers=() filter=()
  [ "${WORKERS:-1}" -gt 1 ] && workers=(-n "$WORKERS") && export XLA_PYTHON_CLIENT_PREALLOCATE=false
  [ -n "${TESTS_K:-}" ] && filter=(-k "$TESTS_K")
  timeout -k 10 "${TEST_S:-300}" python3 -P -m pytest -m gpu -v -p no:cacheprovider \
    "${workers[@]}" "${filter[@]}" "$repo/tests" > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests (rc=$?): $(tail -1 "$OUT/gpu_tests.log")" | tee -a "$OUT/summary.txt"
  grep -E "^FAILED|Error" "$OUT/gpu_tests.log" | head -20
fi

for suite in $SUITES; do
  timeout -k 10 "${SUITE_S:-240}" python3 "$repo/benchmarks/gpu_suites.py" --suite "$suite" \
    --out "$OUT" > "$OUT/bench_$suite.log" 2>&1
  echo "suite $suite (rc=$?) at $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
done
for section in ${HOPPER:-}; do
  mkdir -p "$OUT/hopper_$section"
  timeout -k 10 "${SUITE_S:-240}" python3 "$repo/benchmarks/hopper_forward.py" --only "$section" \
    --out "$OUT/hopper_$section" > "$OUT/hopper_$section.log" 2>&1
  echo "hopper_forward --only $section (rc=$?) at $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
