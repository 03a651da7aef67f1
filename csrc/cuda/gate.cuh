// Gated attention in the CUDA kernels (common/params.h: AttentionShape::
// has_gate, gate_cut): each score gains logsigmoid(alpha_i * delta_j), its gradient dS_ij
// sigmoid(-alpha_i delta_j) goes to dalpha_i with delta_j and to ddelta_j with alpha_i (fp32
// atomics of a block's sums), and with a threshold a kGateBlockQ x kGateBlockK block of the
// fixed grid is dropped whole when every alpha_i * delta_j there lies below gate_cut (tested on
// the bounds of alpha and delta over the grid's blocks, gate.cu's pass). Gated calls run kernels
// of their own (IndexKind kGatedForms, with the forms' and ids' code; the Hopper kernels' kGate
// traits): the block test rides on their tile walks, the score term joins the scores' GEMM.
#pragma once

#include <cmath>

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda::detail {

// logsigmoid(x) = min(x, 0) - log1p(e^-|x|): no cancellation on either side (the CPU kernels'
// form), on the MUFU units (ex2, lg2): log1pf's software routine made a gated forward 5x slower
// than the same call without the gate (H100, L16k D128). 1 + e^-|x| rounds to 1 only where
// e^-|x| < 2^-24, an absolute error below 6e-8 in a score. Trading MUFU ops for more
// instructions on the FMA pipes does not pay: log1p as a degree-7 polynomial and the division
// by Newton steps (one MUFU op each here) made the kernels slower (H100, L16k D128 H16 causal,
// two runs on two machines, each against the same call without the gate (1.60-1.61 / 4.55-4.65):
// Hopper forward 2.71 -> 2.87 ms, backward 9.44 -> 9.61, FlashAttention-2-class forward 3.88 ->
// 5.33).
__device__ __forceinline__ float log_sigmoid(float x) {
  return fminf(x, 0.f) - __logf(1.f + __expf(-fabsf(x)));
}

// d logsigmoid(x) / dx = sigmoid(-x) = 1 / (1 + e^x): no cancellation, and its limits exact
// (e^x = inf gives 0).
__device__ __forceinline__ float log_sigmoid_grad(float x) {
  return __fdividef(1.f, 1.f + __expf(x));
}

// sigmoid(-x) from x2 = x log2(e), as the Hopper backward keeps delta log2(e) per key: 4
// instructions with x2 against 7.
__device__ __forceinline__ float log_sigmoid_grad_log2(float x2) {
  return __fdividef(1.f, 1.f + fast_exp2(x2));
}

// The Hopper kernels' factored gate (calls without a softcap): logsigmoid(x) = min(x, 0) +
// log(sigmoid(|x|)), so exp(s + logsigmoid(x)) = exp(s + min(x, 0)) sigmoid(|x|). The softmax takes
// its maxima over s + min(x, 0) (above the logit by at most ln 2: nothing underflows) and weighs
// each exponential by sigmoid(|x|) = (1 + tanh(|x| / 2)) / 2: one MUFU op an element where
// logsigmoid takes two (ex2, lg2), and 7 instructions against 8. H100, L16k D128 H16 causal:
// gated Hopper forward 2.72 -> 2.37 ms, backward 9.18 -> 9.13 (1.63 / 4.6 without the gate).
// tanh.approx's relative error (< 2^-10.9) leaves the weight within 2^-11 of sigmoid(|x|), below
// P's own rounding to 16 bits (2^-9 in bf16): the harness's gated cases moved from 2.1-2.2e-3 to
// 2.3-2.4e-3 (out, relative L2 in bf16), their lse from ~1e-6 to ~1.5e-6 (absolute).
__device__ __forceinline__ float gate_bound(float x) { return fminf(x, 0.f); }
__device__ __forceinline__ float gate_weight(float half_x) {
  return fmaf(0.5f, fast_tanh(fabsf(half_x)), 0.5f);
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

// The gate of one (batch entry b, query head h): alpha of its rows, delta of its kv head's keys,
// and with a threshold their bounds over the grid's blocks (GateBounds).
struct GateView {
  const float* alpha;  // row i at alpha[i * heads]
  const float* delta;  // key j at delta[j * kv_heads]
  int64_t alpha_entry, delta_entry;  // their offsets in alpha and delta (and their gradients)
  int heads, kv_heads;
  int rows;  // Lq
  const float2* row_bounds;  // [row_blocks], null without a threshold
  const float2* key_bounds;  // [key_blocks]
  int row_blocks, key_blocks;
  double cut;

  template <typename Params>
  __device__ __forceinline__ GateView(const Params& p, int64_t b, int h)
      : heads(static_cast<int>(p.s.num_heads)),
        kv_heads(static_cast<int>(p.s.num_kv_heads)),
        rows(static_cast<int>(p.s.seqlen_q)),
        row_blocks(p.gate_bounds.row_blocks),
        key_blocks(p.gate_bounds.key_blocks),
        cut(p.s.gate_cut) {
    const int hk = h / static_cast<int>(p.s.heads_per_kv_head());
    alpha_entry = p.s.alpha_offset(b, h);
    delta_entry = p.s.delta_offset(b, hk);
    alpha = p.alpha + alpha_entry;
    delta = p.delta + delta_entry;
    const GateBounds& g = p.gate_bounds;
    row_bounds = g.rows != nullptr ? g.rows + (b * heads + h) * row_blocks : nullptr;
    key_bounds = g.keys != nullptr ? g.keys + (b * kv_heads + hk) * key_blocks : nullptr;
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
};

// The threshold's verdicts on the grid blocks a walk visits: the blocks of one grid row (kByKey:
// the key blocks of row block `fixed`, walked down) or of one grid column (the row blocks of key
// block `fixed`, walked up), 32 at a time: a lane's bound each, one ballot. Without a threshold
// every block is kept. Called by whole warps, converged (the walks are CTA-uniform).
template <bool kByKey>
struct GateFilter {
  const float2* walked;  // the bounds of the walked side's blocks
  int blocks;            // how many
  float2 fixed;          // the bound of the fixed block
  double cut;
  int first = 0;         // the window: blocks first, first -+ 1, ... (down by key, up by row)
  uint32_t kept = 0;
  bool loaded = false;

  __device__ __forceinline__ GateFilter(const GateView& g, int fixed_block)
      : walked(kByKey ? g.key_bounds : g.row_bounds),
        blocks(kByKey ? g.key_blocks : g.row_blocks),
        cut(g.cut) {
    const float2* side = kByKey ? g.row_bounds : g.key_bounds;
    fixed = side != nullptr ? side[fixed_block] : make_float2(0.f, 0.f);
  }

  // Whether grid block `block` of the walked side is kept.
  __device__ __forceinline__ bool keeps(int block) {
    if (walked == nullptr) return true;
    const int offset = kByKey ? first - block : block - first;
    if (!loaded || offset < 0 || offset > 31) {
      first = block;
      const int lane = static_cast<int>(threadIdx.x & 31);
      const int mine = kByKey ? block - lane : block + lane;
      bool keep = true;  // blocks past either end: never asked about
      if (mine >= 0 && mine < blocks) {
        const float2 w = walked[mine], a = kByKey ? fixed : w, d = kByKey ? w : fixed;
        keep = GateBlockKept(a.x, a.y, d.x, d.y, cut);
      }
      kept = __ballot_sync(0xffffffffu, keep);
      loaded = true;
      return kept & 1u;
    }
    return kept >> offset & 1u;
  }

  // The first of blocks n (one the walk names), then next_visible(n -+ 1, flags)'s, ... that the
  // threshold keeps, in walking order; `end` (just past the walk) when none is: the walk's tile
  // blocks are kWidth keys (kByKey) or rows wide, nested in the grid's blocks.
  template <int kWidth, typename NextVisible>
  __device__ __forceinline__ int next_kept(int n, int end, NextVisible&& next_visible,
                                           int* flags) {
    constexpr int kGrid = static_cast<int>(kByKey ? kGateBlockK : kGateBlockQ);
    static_assert(kGrid % kWidth == 0, "tiles nest in the gate grid");
    while ((kByKey ? n > end : n < end) && !keeps(n * kWidth / kGrid)) {
      n = next_visible(kByKey ? n - 1 : n + 1, flags);
    }
    return n;
  }
};

// Sums over a warp's 32 lanes of each of 8 values a lane: lane l ends with the sum of v[l >> 2]
// (by recursive halving: 9 shuffles instead of 40).
__device__ __forceinline__ float warp_sum_of_8(float (&v)[8]) {
  const int lane = static_cast<int>(threadIdx.x & 31);
#pragma unroll
  for (int half = 4, o = 16; half > 0; half >>= 1, o >>= 1) {
    const bool upper = lane & o;
#pragma unroll
    for (int k = 0; k < half; ++k) {
      const float other = __shfl_xor_sync(0xffffffffu, upper ? v[k] : v[k + half], o);
      v[k] = (upper ? v[k + half] : v[k]) + other;
    }
  }
  float sum = v[0];
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  return sum;
}

// A block's gradients of the gate from its dS tile (ds(j, i): key j, query i of the block, the
// logits' cotangent, in shared memory), added with fp32 atomics: dalpha_i += sum_j w_ij delta_j
// and ddelta_j += sum_i w_ij alpha_i, w_ij = dS_ij sigmoid(-alpha_i delta_j) (alpha and delta
// of the block staged in shared memory). Each w once: a lane a key, a warp 32 keys over a slice
// of the rows, the rows' sums over the warp by shuffles 8 rows at a time.
template <int BN, int BM, int NT, typename DsAt>
__device__ __forceinline__ void add_gate_grads(const GateView& gate, float* dalpha, float* ddelta,
                                               const float* block_alpha,
                                               const float* block_delta, int n0, int m0,
                                               int kv_len, int q_len, DsAt ds, int tid) {
  constexpr int kKeyGroups = BN / 32, kSlices = NT / BN, kRows = BM / kSlices;
  static_assert(BN % 32 == 0 && NT % BN == 0 && BM % kSlices == 0 && kRows % 8 == 0,
                "whole warps of keys over slices of 8-row chunks");
  const int lane = tid & 31, warp = tid >> 5;
  const int j = warp % kKeyGroups * 32 + lane;
  const int first_row = warp / kKeyGroups * kRows;
  const bool key_in = n0 + j < kv_len;
  const float d = block_delta[j];
  float key_sum = 0.f;
#pragma unroll 1
  for (int chunk = first_row; chunk < first_row + kRows; chunk += 8) {
    float row_sums[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int i = chunk + r;
      const float a = block_alpha[i];
      const float w = key_in && m0 + i < q_len ? ds(j, i) * log_sigmoid_grad(a * d) : 0.f;
      key_sum += w * a;
      row_sums[r] = w * d;
    }
    const float row_sum = warp_sum_of_8(row_sums);
    const int i = chunk + (lane >> 2);
    if ((lane & 3) == 0 && m0 + i < q_len && row_sum != 0.f) {
      atomicAdd(dalpha + gate.row_index(m0 + i), row_sum);
    }
  }
  if (key_in && key_sum != 0.f) atomicAdd(ddelta + gate.key_index(n0 + j), key_sum);
}

}  // namespace dmattn::cuda::detail
