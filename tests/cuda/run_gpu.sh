#!/bin/bash
# Build the CUDA kernels + tests/cuda/kernel_check on a GPU machine, run every case in its own
# process, the benchmarks, and compute-sanitizer on --quick. Logs go to $LOG (default
# build/gpu_logs); a summary is printed last. Sections are gated on elapsed time so that the
# whole run fits ~230 s. When $OUT is set (the device tool's return folder), at most 8 files are
# copied there after each section.
#   ARCH=90a DIMS="64 128" DTYPES="bf16" TUNE=1 tests/cuda/run_gpu.sh
# TUNE=1 also builds tests/cuda/tune_*.cu (alternative tiles, DMATTN_CUDA_VARIANT) and checks
# and times them next to the library's tiles (kernel_check --variants).
# BUILD_ONLY=1 stops after building build/kernel_check (no GPU needed: build it on the development
# machine, where it costs no device time, and send it with the device tool's `carry`);
# PREBUILT=1 skips the build and runs that binary (built with the same DIMS / DTYPES / TUNE).
set -u
LOG=${LOG:-build/gpu_logs}
ARCH=${ARCH:-90a}
DIMS=${DIMS:-"32 64 96 128 192 256"}
DTYPES=${DTYPES:-"bf16 fp16"}
TUNE=${TUNE:-0}
rm -rf build/obj
mkdir -p "$LOG" build/obj
sync_out() {
  [ -n "${OUT:-}" ] || return 0
  for f in summary.txt cases.log bench.log ptxas.txt compile_times.txt; do
    [ -f "$LOG/$f" ] && cp "$LOG/$f" "$OUT/"
  done
  cat "$LOG"/memcheck.log "$LOG"/racecheck.log "$LOG"/synccheck.log "$LOG"/initcheck.log \
    > "$OUT/sanitizers.log" 2>/dev/null
  return 0
}
DEFS=""
SRCS="tests/cuda/kernel_check.cu csrc/cuda/launch.cu csrc/cuda/block_map.cu csrc/cuda/dynamic.cu csrc/cuda/segments.cu csrc/cuda/mask_forms.cu csrc/cuda/gate.cu csrc/cuda/sm90/tensor_maps.cu"
VARIANTS=""
if [ "$TUNE" = 1 ]; then
  DEFS="$DEFS -DDMATTN_CUDA_TUNING=1"
  SRCS="$SRCS $(ls tests/cuda/tune_*.cu | tr '\n' ' ')"
  VARIANTS="--variants"
fi
for d in $DIMS; do
  DEFS="$DEFS -DDMATTN_ENABLE_HDIM$d=1"
  for t in $DTYPES; do
    SRCS="$SRCS csrc/cuda/instantiations/fwd_hdim${d}_$t.cu csrc/cuda/instantiations/bwd_hdim${d}_$t.cu"
  done
done
for t in $DTYPES; do DEFS="$DEFS -DDMATTN_ENABLE_$(echo "$t" | tr a-z A-Z)=1"; done
[ "$ARCH" = 90a ] && DEFS="$DEFS -DDMATTN_SM90A=1"
export FLAGS="-std=c++17 --expt-relaxed-constexpr --use_fast_math -O3 -lineinfo -gencode arch=compute_$ARCH,code=sm_$ARCH -I csrc $DEFS"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$LOG/gpu.txt" 2>&1

t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
if [ "${PREBUILT:-0}" = 1 ]; then
  [ -x build/kernel_check ] || { echo "PREBUILT=1 but no build/kernel_check"; exit 1; }
  echo "prebuilt build/kernel_check" | tee "$LOG/summary.txt"
else
# the tuning files are the slowest: start them first
printf "%s\n" $SRCS | sort -r | xargs -P "$(nproc)" -I{} sh -c \
  'f={}; o=build/obj/$(basename $f).o; /usr/bin/time -f "%e s" nvcc $FLAGS -Xptxas -v -c $f -o $o > $o.log 2>&1 || echo "COMPILE FAILED: $f"'
for f in build/obj/*.log; do echo "== $f: $(tail -1 $f)"; done > "$LOG/compile_times.txt"
cat build/obj/*.log > "$LOG/compile.log"
nvcc -gencode arch=compute_$ARCH,code=sm_$ARCH build/obj/*.o -o build/kernel_check >> "$LOG/compile.log" 2>&1 \
  || { echo "LINK FAILED"; grep -B2 -A8 -E "error" "$LOG/compile.log" | head -80; exit 1; }
echo "build: $(el) s; ptxas wgmma serialisation warnings (C7518, must be 0): $(grep -c C7518 "$LOG/compile.log")" \
  | tee "$LOG/summary.txt"
grep -E "Compiling entry|spill|Used" "$LOG/compile.log" | sed 's/ptxas info    ://' > "$LOG/ptxas.txt"
sync_out
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
fi

# 1. correctness, one process per case (a crash names its case)
: > "$LOG/cases.log"
for c in $(build/kernel_check --list); do
  if [ "$(el)" -gt "${CASES_UNTIL:-125}" ]; then echo "$c  not run (time budget)" >> "$LOG/cases.log"; continue; fi
  timeout -k 5 25 build/kernel_check $VARIANTS --case "$c" > "$LOG/case_$c.log" 2>&1
  rc=$?
  line=$(grep -E "PASS|FAIL|skipped" "$LOG/case_$c.log" | head -1)
  [ -z "$line" ] && line="$c  rc=$rc (crash/timeout): $(grep -v '^device' "$LOG/case_$c.log" | tail -2 | tr '\n' ' ')"
  echo "$line" >> "$LOG/cases.log"
  grep -E "worst|first bad|\^ variant" "$LOG/case_$c.log" >> "$LOG/cases.log"
done
echo "cases done at $(el) s" >> "$LOG/summary.txt"
sync_out

# 2. benchmarks
timeout -k 5 ${BENCH_S:-45} build/kernel_check $VARIANTS --bench-only > "$LOG/bench.log" 2>&1
echo "bench rc=$? done at $(el) s" >> "$LOG/summary.txt"
sync_out

# 3. sanitizers on the quick cases, while time allows
san() {
  if [ "$(el)" -gt "$2" ]; then echo "$1 not run (time budget)" >> "$LOG/summary.txt"; return; fi
  timeout -k 5 "$3" compute-sanitizer --tool "$1" build/kernel_check --quick > "$LOG/$1.log" 2>&1
  echo "$1 rc=$?: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOG/$1.log" | tail -1);" \
    "failed cases: $(grep -c ' FAIL' "$LOG/$1.log")" >> "$LOG/summary.txt"
}
san memcheck 200 25
san racecheck 200 30
san synccheck 215 15
san initcheck 215 15
echo "total $(el) s" >> "$LOG/summary.txt"
sync_out

echo "================ ptxas (kernels with spills) ================"
grep -B1 -E "[1-9][0-9]* bytes spill stores" "$LOG/ptxas.txt" | grep -oE "(fwd|bwd|dq)_kernel[^']*|[0-9]+ bytes spill stores" | paste - - | sort -u | head -30
echo "================ sanitizers ================"
grep -hE "Invalid|Race|hazard|Uninitialized|Barrier|ERROR" "$LOG"/memcheck.log "$LOG/racecheck.log" "$LOG/synccheck.log" "$LOG/initcheck.log" 2>/dev/null | sort | uniq -c | head -20
echo "================ cases ================"
cat "$LOG/cases.log"
echo "================ bench ================"
cat "$LOG/bench.log"
echo "================ summary ================"
cat "$LOG/summary.txt"
cat "$LOG/gpu.txt"
