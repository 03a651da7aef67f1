#!/bin/bash
# Build the CUDA kernels + tests/cuda/kernel_check on a GPU machine, run every case in its own
# process, compute-sanitizer memcheck/racecheck on --quick, and the benchmarks. Logs go to
# $OUT (default build/gpu_logs); a summary is printed last.
#   ARCH=90 DIMS="64 128" DTYPES="bf16" tests/cuda/run_gpu.sh
set -u
OUT=${OUT:-build/gpu_logs}
ARCH=${ARCH:-90}
DIMS=${DIMS:-"32 64 96 128 192 256"}
DTYPES=${DTYPES:-"bf16 fp16"}
rm -rf build/obj
mkdir -p "$OUT" build/obj
DEFS=""
SRCS="tests/cuda/kernel_check.cu csrc/cuda/launch.cu"
for d in $DIMS; do
  DEFS="$DEFS -DDMATTN_ENABLE_HDIM$d=1"
  for t in $DTYPES; do
    SRCS="$SRCS csrc/cuda/instantiations/fwd_hdim${d}_$t.cu csrc/cuda/instantiations/bwd_hdim${d}_$t.cu"
  done
done
for t in $DTYPES; do DEFS="$DEFS -DDMATTN_ENABLE_$(echo "$t" | tr a-z A-Z)=1"; done
export FLAGS="-std=c++17 --expt-relaxed-constexpr --use_fast_math -O3 -lineinfo -gencode arch=compute_$ARCH,code=sm_$ARCH -I csrc -I .cutlass/include $DEFS"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1

t0=$(date +%s)
printf "%s\n" $SRCS | xargs -P "$(nproc)" -I{} sh -c \
  'f={}; o=build/obj/$(basename $f).o; /usr/bin/time -f "%e s" nvcc $FLAGS -Xptxas -v -c $f -o $o > $o.log 2>&1 || echo "COMPILE FAILED: $f"'
cat build/obj/*.log > "$OUT/compile.log"
nvcc -gencode arch=compute_$ARCH,code=sm_$ARCH build/obj/*.o -o build/kernel_check >> "$OUT/compile.log" 2>&1 \
  || { echo "LINK FAILED"; tail -50 "$OUT/compile.log"; exit 1; }
t1=$(date +%s)
echo "build: $((t1 - t0)) s" | tee "$OUT/summary.txt"
grep -E "Compiling entry|spill|Used" "$OUT/compile.log" | sed 's/ptxas info    ://' > "$OUT/ptxas.txt"

: > "$OUT/cases.log"
for c in $(build/kernel_check --list); do
  if [ $(( $(date +%s) - t0 )) -gt 140 ]; then echo "$c  not run (time budget)" >> "$OUT/cases.log"; continue; fi
  timeout -k 5 25 build/kernel_check --case "$c" > "$OUT/case_$c.log" 2>&1
  rc=$?
  line=$(grep -E "PASS|FAIL|skipped" "$OUT/case_$c.log" | head -1)
  [ -z "$line" ] && line="$c  rc=$rc (crash/timeout): $(grep -v '^device' "$OUT/case_$c.log" | tail -2 | tr '\n' ' ')"
  echo "$line" >> "$OUT/cases.log"
  grep -E "worst|first bad" "$OUT/case_$c.log" >> "$OUT/cases.log"
done
t2=$(date +%s)

timeout -k 5 40 compute-sanitizer --tool memcheck build/kernel_check --quick > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)" >> "$OUT/summary.txt"
timeout -k 5 40 compute-sanitizer --tool racecheck build/kernel_check --quick > "$OUT/racecheck.log" 2>&1
echo "racecheck rc=$?: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -1)" >> "$OUT/summary.txt"
for tool in synccheck initcheck; do
  timeout -k 5 40 compute-sanitizer --tool $tool build/kernel_check --quick > "$OUT/$tool.log" 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/$tool.log" | tail -1)" >> "$OUT/summary.txt"
done
# memcheck on larger irregular cases (one per head dim family), while time allows
: > "$OUT/memcheck_cases.log"
for c in ${MEMCHECK_CASES:-irregular_q17_k129_d96_mask_bias softcap_d256_bias window40_10_d192_bias1row vmap_grads_full_d64 gqa_bcast_kv_summed_d128 seqlens_d32 kvbatch_bcast_d64_atomic_bias}; do
  if [ $(( $(date +%s) - t0 )) -gt 200 ]; then echo "$c memcheck not run (time budget)" >> "$OUT/summary.txt"; continue; fi
  timeout -k 5 30 compute-sanitizer --tool memcheck build/kernel_check --case "$c" >> "$OUT/memcheck_cases.log" 2>&1
  echo "memcheck $c rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_cases.log" | tail -1)" >> "$OUT/summary.txt"
done
t3=$(date +%s)
timeout -k 5 60 build/kernel_check --bench-only > "$OUT/bench.log" 2>&1
t4=$(date +%s)
echo "cases $((t2 - t1)) s, sanitizers $((t3 - t2)) s, bench $((t4 - t3)) s" >> "$OUT/summary.txt"

echo "================ ptxas (kernels with spills) ================"
grep -B1 -E "[1-9][0-9]* bytes spill stores" "$OUT/ptxas.txt" | grep -oE "(fwd|bwd|dq)_kernel[^']*|[0-9]+ bytes spill stores" | paste - - | sort -u | head -30
echo "================ sanitizers ================"
grep -hE "Invalid|Race|hazard|Uninitialized|Barrier|ERROR" "$OUT"/memcheck*.log "$OUT/racecheck.log" "$OUT/synccheck.log" "$OUT/initcheck.log" | sort | uniq -c | head -20
echo "================ bench ================"
cat "$OUT/bench.log"
echo "================ summary ================"
cat "$OUT/summary.txt"
cat "$OUT/gpu.txt"
echo "================ cases ================"
cat "$OUT/cases.log"
