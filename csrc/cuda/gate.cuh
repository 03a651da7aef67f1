// Gated attention in the FlashAttention-2-class kernels (common/params.h: AttentionShape::
// has_gate, gate_cut): each score gains logsigmoid(alpha_i * delta_j), its gradient dS_ij
// sigmoid(-alpha_i delta_j) goes to dalpha_i with delta_j and to ddelta_j with alpha_i (fp32
// atomics of a block's sums), and with a threshold a kGateBlockQ x kGateBlockK block of the
// fixed grid is dropped whole when every alpha_i * delta_j there lies below gate_cut. Gated
// calls run kernels of their own (IndexKind kGatedForms, with the forms' and ids' code): the
// block test rides on their tile walks, the score term follows the scores' GEMM.
#pragma once

#include <cmath>

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda::detail {

// logsigmoid(x) = min(x, 0) - log1p(e^-|x|): no cancellation on either side (the CPU kernels'
// form), on the MUFU units (ex2, lg2): log1pf's software routine made a gated forward 5x slower
// than the same call without the gate (H100, L16k D128). 1 + e^-|x| rounds to 1 only where
// e^-|x| < 2^-24, an absolute error below 6e-8 in a score.
__device__ __forceinline__ float log_sigmoid(float x) {
  return fminf(x, 0.f) - __logf(1.f + __expf(-fabsf(x)));
}

// d logsigmoid(x) / dx = sigmoid(-x), in the form without cancellation on either side.
__device__ __forceinline__ float log_sigmoid_grad(float x) {
  const float e = __expf(-fabsf(x));
  return (x >= 0.f ? e : 1.f) / (1.f + e);
}

// [min, max] of 0 < n <= 128 floats `stride` apart, in double, by the whole warp (each lane
// four values, then shuffles; every lane gets the result); both NaN where any value is NaN (the
// CPU kernels' MinMax: fminf / fmaxf alone would pass a NaN over).
static_assert(kGateBlockQ <= 128 && kGateBlockK <= 128, "a grid block's side: four values a lane");
__device__ __forceinline__ void warp_min_max(const float* x, int n, int64_t stride, double* lo,
                                             double* hi) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  float a = INFINITY, b = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = lane + 32 * k;
    if (i < n) {
      const float v = __ldg(x + i * stride);
      nan |= isnan(v);
      a = fminf(a, v);
      b = fmaxf(b, v);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a = fminf(a, __shfl_xor_sync(0xffffffffu, a, o));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, o));
  }
  nan = __any_sync(0xffffffffu, nan);
  *lo = nan ? NAN : a;
  *hi = nan ? NAN : b;
}

// n <= N floats `stride` apart at src into dst by cp.async (zeros past n).
template <int N, int NT>
__device__ __forceinline__ void load_strided_async(float* dst, const float* src, int stride, int n,
                                                   int tid) {
#pragma unroll
  for (int i = tid; i < N; i += NT) {
    const bool ok = i < n;
    cp_async4(smem_u32(dst + i), ok ? src + static_cast<int64_t>(i) * stride : src, ok ? 4 : 0);
  }
}

// The gate of one (batch entry b, query head h): alpha of its rows, delta of its kv head's keys.
struct GateView {
  const float* alpha;  // row i at alpha[i * heads]
  const float* delta;  // key j at delta[j * kv_heads]
  int64_t alpha_entry, delta_entry;  // their offsets in alpha and delta (and their gradients)
  int heads, kv_heads;
  int rows, cols;  // Lq, Lk: the grid's blocks end there whatever the sequence lengths
  double cut;      // gate_cut; -inf: no threshold

  template <typename Params>
  __device__ __forceinline__ GateView(const Params& p, int64_t b, int h)
      : heads(static_cast<int>(p.s.num_heads)),
        kv_heads(static_cast<int>(p.s.num_kv_heads)),
        rows(static_cast<int>(p.s.seqlen_q)),
        cols(static_cast<int>(p.s.seqlen_k)),
        cut(p.s.gate_cut) {
    alpha_entry = p.s.alpha_offset(b, h);
    delta_entry = p.s.delta_offset(b, h / static_cast<int>(p.s.heads_per_kv_head()));
    alpha = p.alpha != nullptr ? p.alpha + alpha_entry : nullptr;
    delta = p.delta != nullptr ? p.delta + delta_entry : nullptr;
  }

  // Where row i's alpha and key j's delta (and their gradients) are.
  __device__ __forceinline__ int64_t row_index(int i) const {
    return alpha_entry + static_cast<int64_t>(i) * heads;
  }
  __device__ __forceinline__ int64_t key_index(int j) const {
    return delta_entry + static_cast<int64_t>(j) * kv_heads;
  }

  // alpha_i (0 past the last row: such rows are hidden).
  __device__ __forceinline__ float row(int i) const {
    return i < rows ? __ldg(alpha + static_cast<int64_t>(i) * heads) : 0.f;
  }

  // cp.async of the delta of keys [j0, j0 + n) (n <= N; zeros past them) or the alpha of rows
  // [i0, i0 + n) into shared memory, in the commit group of the block's tiles: read where the
  // scores are, one load from global memory a key (or row) instead of one an element.
  template <int N, int NT>
  __device__ __forceinline__ void load_keys_async(float* dst, int j0, int n, int tid) const {
    load_strided_async<N, NT>(dst, delta + static_cast<int64_t>(j0) * kv_heads, kv_heads, n, tid);
  }
  template <int N, int NT>
  __device__ __forceinline__ void load_rows_async(float* dst, int i0, int n, int tid) const {
    load_strided_async<N, NT>(dst, alpha + static_cast<int64_t>(i0) * heads, heads, n, tid);
  }

  // Whether the threshold keeps the grid block holding row r0 and key c0: unless every corner
  // product of alpha's and delta's [min, max] over the block lies below the cut (in double,
  // exact for float32 values; a NaN corner keeps it, as on the CPU). Called by whole warps,
  // converged (the walks are CTA-uniform).
  __device__ __forceinline__ bool keeps(int r0, int c0) const {
    if (!(cut > -INFINITY)) return true;
    const int i0 = r0 / static_cast<int>(kGateBlockQ) * static_cast<int>(kGateBlockQ);
    const int j0 = c0 / static_cast<int>(kGateBlockK) * static_cast<int>(kGateBlockK);
    double a_lo, a_hi, d_lo, d_hi;
    warp_min_max(alpha + static_cast<int64_t>(i0) * heads,
                 min(static_cast<int>(kGateBlockQ), rows - i0), heads, &a_lo, &a_hi);
    warp_min_max(delta + static_cast<int64_t>(j0) * kv_heads,
                 min(static_cast<int>(kGateBlockK), cols - j0), kv_heads, &d_lo, &d_hi);
    const double corners[4] = {a_lo * d_lo, a_lo * d_hi, a_hi * d_lo, a_hi * d_hi};
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (!(corners[k] < cut)) return true;
    return false;
  }
};

// A block's gradients of the gate from its dS tile (ds(j, i): key j, query i of the block, the
// logits' cotangent, in shared memory), added with fp32 atomics: dalpha_i += sum_j dS_ij
// sigmoid(-x_ij) delta_j and ddelta_j += sum_i dS_ij sigmoid(-x_ij) alpha_i (x = alpha_i
// delta_j; alpha and delta of the block staged in shared memory), NT / BN threads a key and
// NT / BM a row, each over a slice of the other side.
template <int BN, int BM, int NT, typename DsAt>
__device__ __forceinline__ void add_gate_grads(const GateView& gate, float* dalpha, float* ddelta,
                                               const float* block_alpha,
                                               const float* block_delta, int n0, int m0,
                                               int kv_len, int q_len, DsAt ds, int tid) {
  static_assert(NT % BN == 0 && NT % BM == 0, "whole slices of keys and rows");
  constexpr int kKeySlices = NT / BN, kRowSlices = NT / BM;
  {
    const int j = tid % BN, slice = tid / BN;
    if (n0 + j < kv_len) {
      const float d = block_delta[j];
      float sum = 0.f;
      for (int i = slice; i < BM && m0 + i < q_len; i += kKeySlices) {
        const float a = block_alpha[i];
        sum += ds(j, i) * log_sigmoid_grad(a * d) * a;
      }
      if (sum != 0.f) atomicAdd(ddelta + gate.key_index(n0 + j), sum);
    }
  }
  {
    const int i = tid % BM, slice = tid / BM;
    if (m0 + i < q_len) {
      const float a = block_alpha[i];
      float sum = 0.f;
      for (int j = slice; j < BN && n0 + j < kv_len; j += kRowSlices) {
        const float d = block_delta[j];
        sum += ds(j, i) * log_sigmoid_grad(a * d) * d;
      }
      if (sum != 0.f) atomicAdd(dalpha + gate.row_index(m0 + i), sum);
    }
  }
}

}  // namespace dmattn::cuda::detail
