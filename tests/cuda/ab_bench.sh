#!/bin/bash
# Two kernel codes side by side on one GPU: kernel_check built from the working tree ("new") and
# from $BASE ("old": a folder holding another commit's csrc/ and tests/, e.g. made here with
#   mkdir -p .exp/base && git archive <commit> csrc tests | tar -x -C .exp/base
# and sent with the device tool's `carry`), each case of the new build checked in its own
# process, the benchmarks whose names hold one of $NAMES ('|'-separated) run interleaved twice,
# the mask pass timed by ncu in both, compute-sanitizer on --quick (SAN=1). Timings compare only
# within one run (DESIGN.md §5). Logs and summary.txt go to $LOG (default build/ab_logs).
#   BASE=.exp/base NAMES='bias+mask|dense d128 L4k B4 H16 causal' SAN=1 tests/cuda/ab_bench.sh
set -u
BASE=${BASE:?a folder with another commit csrc/ and tests/ in it}
LOG=${LOG:-build/ab_logs}
DIMS=${DIMS:-"64 128"}
mkdir -p "$LOG"
t0=$SECONDS
DEFS="-DDMATTN_SM90A=1 -DDMATTN_ENABLE_BF16=1 -DDMATTN_ENABLE_FP16=1"
for d in $DIMS; do DEFS="$DEFS -DDMATTN_ENABLE_HDIM$d=1"; done
FLAGS="-std=c++17 --expt-relaxed-constexpr --use_fast_math -O3 -lineinfo -gencode arch=compute_90a,code=sm_90a $DEFS"
build() {  # root name: every source of that root's kernels, compiled in parallel
  local root=$1 obj=build/ab_$2 srcs
  mkdir -p "$obj"
  srcs="tests/cuda/kernel_check.cu csrc/cuda/sm90/tensor_maps.cu $(cd "$root" && ls csrc/cuda/*.cu)"
  for d in $DIMS; do srcs="$srcs $(cd "$root" && ls csrc/cuda/instantiations/*_hdim${d}_*.cu)"; done
  for f in $srcs; do
    nvcc $FLAGS -I "$root/csrc" -c "$root/$f" -o "$obj/$(basename "$f").o" > "$obj/$(basename "$f").log" 2>&1 \
      || echo "COMPILE FAILED ($2): $f" | tee -a "$LOG/summary.txt" &
  done
}
build . new
build "$BASE" old
wait
for v in new old; do
  nvcc -gencode arch=compute_90a,code=sm_90a build/ab_$v/*.o -o build/kc_$v > "$LOG/link_$v.txt" 2>&1 \
    || echo "LINK FAILED ($v)" | tee -a "$LOG/summary.txt"
done
echo "built in $((SECONDS - t0)) s" | tee -a "$LOG/summary.txt"

: > "$LOG/cases.txt"
for c in $(build/kc_new --list); do
  timeout -k 5 25 build/kc_new --case "$c" > "$LOG/case.log" 2>&1
  rc=$?
  line=$(grep -E "PASS|FAIL|skipped" "$LOG/case.log" | head -1)
  echo "${line:-$c rc=$rc CRASH $(tail -2 "$LOG/case.log" | tr '\n' ' ')}" >> "$LOG/cases.txt"
done
echo "cases: $(grep -c PASS "$LOG/cases.txt") pass, $(grep -c FAIL "$LOG/cases.txt") fail," \
  "$(grep -c CRASH "$LOG/cases.txt") crash" | tee -a "$LOG/summary.txt"
grep -E "FAIL|CRASH" "$LOG/cases.txt" | tee -a "$LOG/summary.txt"

while IFS= read -r name; do
  for rep in 1 2; do
    for v in new old; do
      echo "== $v run $rep: $name" >> "$LOG/bench.txt"
      timeout 60 build/kc_$v --bench-only --only "$name" 2>&1 | grep -vE "^device|^case|^bench|^$" >> "$LOG/bench.txt"
    done
  done
done < <(printf '%s\n' "${NAMES:-bias+mask}" | tr '|' '\n')
for v in new old; do
  timeout 60 ncu --clock-control none --kernel-name regex:mask_block_map --launch-count 3 \
    --metrics gpu__time_duration.sum build/kc_$v --bench-only --only "${MAP_BENCH:-50%}" > "$LOG/ncu_map_$v.txt" 2>&1
  echo "mask pass ($v): $(grep gpu__time_duration "$LOG/ncu_map_$v.txt" | awk '{print $NF}' | tr '\n' ' ') us" \
    | tee -a "$LOG/summary.txt"
done
if [ "${SAN:-0}" = 1 ]; then
  for tool in memcheck racecheck synccheck initcheck; do
    timeout 120 compute-sanitizer --tool $tool build/kc_new --quick > "$LOG/san_$tool.txt" 2>&1
    echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/san_$tool.txt" | tail -1)," \
      "failed cases $(grep -c FAIL "$LOG/san_$tool.txt")" | tee -a "$LOG/summary.txt"
  done
fi
echo "done in $((SECONDS - t0)) s" | tee -a "$LOG/summary.txt"
