// Split-KV combine: merges the partial results of the key splits (fwd_kernel.cuh, FwdParams) into
// out and lse. For one row with partial lse_s and normalised partial output O_s:
//   lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) O_s
// A split that saw no visible key has lse_s = -inf and weighs nothing; a row with none at all
// gets out = 0 and lse = -inf, as without splits.
#pragma once

#include <cmath>

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda {

constexpr int kCombineWarps = 4;

// Merges row `row` of the `rows` = B * H * Lq rows of the splits' partial results into out and
// lse; lane l of the calling warp owns columns l + 32 i. (The partial results may come from other
// CTAs of the same grid: read through L2.)
template <int D, typename T>
__device__ __forceinline__ void combine_row(const FwdParams& p, int64_t row, int64_t rows,
                                            int lane) {
  static_assert(D % 32 == 0, "whole columns per lane");
  constexpr int kCols = D / 32;
  float max_lse = -INFINITY;
  for (int sp = lane; sp < p.num_splits; sp += 32) {
    max_lse = fmaxf(max_lse, __ldcg(p.lse_partial + sp * rows + row));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, o));
  }
  float sum = 0.f;
  if (max_lse != -INFINITY) {
    for (int sp = lane; sp < p.num_splits; sp += 32) {
      sum += expf(__ldcg(p.lse_partial + sp * rows + row) - max_lse);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = sum > 0.f ? max_lse + logf(sum) : -INFINITY;

  // (Unrolled without a test of the weight, so that several splits' loads are in flight; a split
  // of weight 0 wrote zeros.)
  float acc[kCols] = {};
  if (sum > 0.f) {
#pragma unroll 4
    for (int sp = 0; sp < p.num_splits; ++sp) {
      const float w = expf(__ldcg(p.lse_partial + sp * rows + row) - lse);
      const float* part = p.o_partial + (sp * rows + row) * D;
#pragma unroll
      for (int i = 0; i < kCols; ++i) acc[i] += w * __ldcg(part + lane + 32 * i);
    }
  }

  const AttentionShape& s = p.s;
  const int64_t H = s.num_heads, Lq = s.seqlen_q;
  const int64_t q_row = row % Lq, bh = row / Lq;
  const int64_t b = bh / H, h = bh % H;
  const int64_t at = s.q_offset(b, h) + q_row * s.q_row_stride() + lane;
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    if (p.out_f32) {
      static_cast<float*>(p.out)[at + 32 * i] = acc[i];
    } else {
      static_cast<T*>(p.out)[at + 32 * i] = detail::Elem<T>::from_float(acc[i]);
    }
  }
  if (lane == 0) p.lse[s.lse_offset(b, h) + q_row] = lse;
}

// One warp per (batch, head, query row) of `rows` = B * H * Lq.
template <int D, typename T>
__global__ void __launch_bounds__(kCombineWarps * 32)
    fwd_combine_kernel(const __grid_constant__ FwdParams p, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (row < rows) combine_row<D, T>(p, row, rows, threadIdx.x & 31);
}

}  // namespace dmattn::cuda
