// The bounds pass of the gate threshold (kernel_params.h: GateBounds): one warp per grid block
// of alpha's rows or delta's keys, four values a lane, min and max by warp reductions. alpha and
// delta are O(L) and read once per call, so the walks test a grid block with two 8-byte loads
// instead of reading its 256 values.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.h"

namespace dmattn::cuda {
namespace {

constexpr int kBoundWarps = 8;
static_assert(kGateBlockQ == 128 && kGateBlockK == 128, "four values a lane");

// Warp `cell`'s block: row cells first ([batch, H, row_blocks]), then key cells ([batch, Hk,
// key_blocks]).
__global__ void __launch_bounds__(kBoundWarps * 32)
    gate_bounds_kernel(AttentionShape s, const float* alpha, const float* delta, GateBounds g,
                       float2* rows, float2* keys) {
  const int64_t row_cells = s.batch_count() * s.num_heads * g.row_blocks;
  const int64_t key_cells = s.batch_count() * s.num_kv_heads * g.key_blocks;
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kBoundWarps + (threadIdx.x >> 5);
  if (cell >= row_cells + key_cells) return;  // whole warps only
  const bool is_row = cell < row_cells;
  const int64_t rel = is_row ? cell : cell - row_cells;
  const int blocks = is_row ? g.row_blocks : g.key_blocks;
  const int64_t heads = is_row ? s.num_heads : s.num_kv_heads;
  const int64_t entry = rel / blocks, b = entry / heads, h = entry % heads;
  const int64_t first = rel % blocks * kGateBlockQ;
  const int64_t len = is_row ? s.seqlen_q : s.seqlen_k;
  const float* x = is_row ? alpha + s.alpha_offset(b, h) : delta + s.delta_offset(b, h);
  float lo = INFINITY, hi = -INFINITY;
  bool nan = false;
  for (int64_t i = first + (threadIdx.x & 31); i < first + kGateBlockQ && i < len; i += 32) {
    const float v = x[i * heads];
    nan |= isnan(v);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  // fminf / fmaxf pass a NaN over: the CPU kernels' MinMax keeps it
  nan = __any_sync(0xffffffffu, nan);
  if ((threadIdx.x & 31) == 0) {
    (is_row ? rows : keys)[rel] = nan ? make_float2(NAN, NAN) : make_float2(lo, hi);
  }
}

GateBounds GateBoundsLayout(const AttentionShape& s) {
  GateBounds g;
  g.row_blocks = static_cast<int>((s.seqlen_q + kGateBlockQ - 1) / kGateBlockQ);
  g.key_blocks = static_cast<int>((s.seqlen_k + kGateBlockK - 1) / kGateBlockK);
  return g;
}

int64_t RowBoundBytes(const AttentionShape& s) {
  return s.batch_count() * s.num_heads * GateBoundsLayout(s).row_blocks *
         static_cast<int64_t>(sizeof(float2));
}

}  // namespace

int64_t GateBoundsBytes(const AttentionShape& s) {
  if (!s.has_gate_threshold()) return 0;
  const int64_t keys = s.batch_count() * s.num_kv_heads * GateBoundsLayout(s).key_blocks *
                       static_cast<int64_t>(sizeof(float2));
  return (RowBoundBytes(s) + keys + 255) / 256 * 256;
}

cudaError_t BuildGateBounds(const AttentionShape& s, const float* alpha, const float* delta,
                            uint8_t* workspace, GateBounds* bounds, cudaStream_t stream) {
  *bounds = GateBounds{};
  if (GateBoundsBytes(s) == 0) return cudaSuccess;
  if (alpha == nullptr || delta == nullptr) return cudaErrorInvalidValue;
  GateBounds g = GateBoundsLayout(s);
  auto* rows = reinterpret_cast<float2*>(workspace);
  auto* keys = reinterpret_cast<float2*>(workspace + RowBoundBytes(s));
  const int64_t cells = s.batch_count() * (s.num_heads * g.row_blocks +
                                           s.num_kv_heads * g.key_blocks);
  if (cells == 0) return cudaSuccess;
  const int64_t blocks = (cells + kBoundWarps - 1) / kBoundWarps;
  gate_bounds_kernel<<<static_cast<unsigned>(blocks), kBoundWarps * 32, 0, stream>>>(
      s, alpha, delta, g, rows, keys);
  g.rows = rows;
  g.keys = keys;
  *bounds = g;
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
