#!/usr/bin/env bash
# One GPU-machine session: build jax_dmattn with its CUDA kernels (timed), run the `gpu` tests,
# then the benchmark suites. Every step has its own time limit and its log under $OUT.
#   OUT=/tmp/out DIMS="64;128" TEST_S=300 WORKERS=1 SUITES="dynamic density" benchmarks/gpu_session.sh
# WORKERS > 1 spreads the tests over pytest-xdist processes sharing the GPU (each without JAX's
# memory preallocation); the full gpu suite takes more than 5 minutes in one process.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$repo/build/gpu_session}
DIMS=${DIMS:-"32;64;96;128;192;256"}
SUITES=${SUITES:-"dense bias_mask dynamic density"}
mkdir -p "$OUT"
t0=$SECONDS
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

(cd "$repo" && python3 -m pip install --no-build-isolation --no-deps --target /tmp/site \
  -C cmake.define.JAX_DMATTN_CUDA=ON -C cmake.define.JAX_DMATTN_CUDA_ARCHS=90a \
  -C "cmake.define.JAX_DMATTN_HEAD_DIMS=$DIMS" .) > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build (sm_90a, head dims $DIMS, bf16+fp16, $CMAKE_BUILD_PARALLEL_LEVEL jobs): $((SECONDS - t0)) s" \
  | tee "$OUT/summary.txt"

# Run from outside the repository so that the installed package, not the source tree, is imported.
cd /tmp && export PYTHONPATH=/tmp/site
workers=()
[ "${WORKERS:-1}" -gt 1 ] && workers=(-n "$WORKERS") && export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout -k 10 "${TEST_S:-300}" python3 -P -m pytest -m gpu -v -p no:cacheprovider "${workers[@]}" \
  "$repo/tests" \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests (rc=$?): $(tail -1 "$OUT/gpu_tests.log")" | tee -a "$OUT/summary.txt"

for suite in $SUITES; do
  timeout -k 10 "${SUITE_S:-240}" python3 "$repo/benchmarks/gpu_suites.py" --suite "$suite" \
    --out "$OUT" > "$OUT/bench_$suite.log" 2>&1
  echo "suite $suite (rc=$?) at $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
done
grep -E "FAIL|Error" "$OUT/gpu_tests.log" | head -20
cat "$OUT/summary.txt"
