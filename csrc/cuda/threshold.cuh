// Softmax-threshold skipping (AttentionShape::softmax_threshold) as the forward kernels apply it:
// the pieces of the rule one thread computes for the rows it holds. The rule's grid blocks are
// 64 rows x 128 keys, one tile of the FlashAttention-2-class threshold kernel and one consumer
// warpgroup's rows in the Hopper one; each kernel votes over its block's threads its own way.
#pragma once

#include <cmath>

#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda::detail {

// log2(threshold / n_i) for query row i, n_i the keys it may see by position alone (lengths, the
// band and, with a window table, its kv head's sink: PositionRule::sees; 0 for a row without
// any, which never holds a visible score).
__device__ __forceinline__ float threshold_log2_ratio(float threshold, int i, const SeqLens& lens,
                                                      const PositionRule& rule) {
  if (i >= lens.q_len) return 0.f;
  const int band_lo = max(0, i + rule.band.dmin);
  const int band_hi = min(lens.kv_len, i + rule.band.dmax + 1);
  const int sink_lo = max(0, i + rule.outer.dmin);
  const int sink_hi = min(min(lens.kv_len, rule.sink), i + rule.outer.dmax + 1);
  const int keys = max(0, band_hi - band_lo) + max(0, sink_hi - sink_lo) -
                   max(0, min(band_hi, sink_hi) - max(band_lo, sink_lo));
  return keys > 0 ? log2f(threshold / static_cast<float>(keys)) : 0.f;
}
__device__ __forceinline__ float threshold_log2_ratio(float threshold, int i, const SeqLens& lens,
                                                      const Band& band) {
  return threshold_log2_ratio(threshold, i, lens, PositionRule{band, band, 0});
}

// A thread's verdicts on a block from its two rows (the accumulator rows g and g + 8 of a 16-row
// MMA tile: s[4 t + 2 half + e], -inf where hidden, in accumulator units; m, l: the rows' running
// maximum and this thread's part of their sums over the blocks kept so far): whether one of them
// keeps the block (its maximum there reaches its running log2-sum-exp plus log2_ratio) and
// whether one of them sees a score there. Quad-wide: the four threads of a row call it together.
struct RowVerdict {
  bool keep, seen;
};
template <int N>
__device__ __forceinline__ RowVerdict row_verdict(const float (&s)[N], const float (&m)[2],
                                                  const float (&l)[2],
                                                  const float (&log2_ratio)[2], float mul) {
  RowVerdict v{false, false};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float part[4];  // four chains: the verdict is on the critical path
#pragma unroll
    for (int t = 0; t < N / 4; ++t) {
      const float pair = fmaxf(s[4 * t + 2 * half], s[4 * t + 2 * half + 1]);
      part[t % 4] = t < 4 ? pair : fmaxf(part[t % 4], pair);
    }
    float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
    float sum = l[half];
#pragma unroll
    for (int lanes = 1; lanes <= 2; lanes *= 2) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, lanes));
      sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
    }
    // The row's log2-sum-exp so far (in units of exp2(acc * mul - m * mul)) plus the ratio.
    const float cut = sum > 0.f ? m[half] * mul + __log2f(sum) + log2_ratio[half] : -INFINITY;
    v.seen = v.seen || mx > -INFINITY;
    v.keep = v.keep || (mx > -INFINITY && mx * mul >= cut);
  }
  return v;
}

// Whether `pred` holds for any thread of the CTA (a barrier of all its threads). From lane 0:
// the compiler then knows the result warp-uniform (a wgmma under a branch it cannot prove
// uniform serialises every wgmma of the kernel).
__device__ __forceinline__ bool cta_any(bool pred) {
  return __shfl_sync(0xffffffffu, __syncthreads_or(pred), 0) != 0;
}

}  // namespace dmattn::cuda::detail
