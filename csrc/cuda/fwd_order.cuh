// Heaviest-first order of the forward's query blocks (FwdParams::block_order).
//
// The forward's CTAs start in grid order, a few per SM. When the mask varies over queries and
// keys, a (batch, head)'s query blocks visit very different numbers of non-empty key tiles (2 to
// 23 of 128 for a 10 % block mask), and in plain order a heavy block that starts in the last
// wave runs on while the other SMs idle (30 % of the H=2 L16k 10 % forward's SM time). Ranking
// each (batch, head)'s query blocks by their work, most first, lets the light ones fill in
// behind (longest processing time first). Grid order stays (batch, head)-major, so the CTAs that
// run together still share K and V in L2.
//
// Two small kernels (about 5 us together at L16k H2; their time is memory latency, so the counts
// take one warp per query block): fwd_block_weight_kernel counts the non-empty mask-map cells
// each query block visits within its visible key range, fwd_block_order_kernel sorts one (batch,
// head)'s blocks by that count (a counting sort on kOrderBins bins; ties in any order).
#pragma once

#include "cuda/block_map.cuh"
#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda {

constexpr int kWeightWarps = 8;
constexpr int kOrderThreads = 256;
constexpr int kOrderBins = 256;  // an approximate order is as good as an exact one
static_assert(kOrderBins % 32 == 0, "the scan gives each lane of a warp as many bins");

// block_weight[bh * m_blocks + m]: the non-empty cells of the mask map that query block m of
// (batch, head) bh visits. One warp per query block.
template <int BM, int BN>
__global__ void __launch_bounds__(kWeightWarps * 32)
    fwd_block_weight_kernel(const __grid_constant__ FwdParams p) {
  using namespace detail;
  static_assert(BM % kMaskMapCell == 0 && BN % kMaskMapCell == 0, "tiles cover whole cells");
  const AttentionShape& s = p.s;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * kWeightWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (block >= s.batch_count() * s.num_heads * p.m_blocks) return;  // whole warps only
  const int64_t bh = block / p.m_blocks;
  const int m = static_cast<int>(block % p.m_blocks);
  const int64_t b = bh / s.num_heads;
  const int h = static_cast<int>(bh % s.num_heads);
  const SeqLens L = seq_lens(s, p.q_lens, p.kv_lens, b);
  const BlockRange keys = visible_key_blocks<BM, BN>(L, make_band(s), m * BM);
  const MaskMapView map(p.mask_map, s, b, h);

  const int row0 = m * (BM / kMaskMapCell), rows = min(BM / kMaskMapCell, map.rows - row0);
  const int col0 = keys.lo * (BN / kMaskMapCell);
  const int cols = min(keys.hi * (BN / kMaskMapCell), map.cols) - col0;
  int cells = 0;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = map.cells + static_cast<int64_t>(row0 + r) * map.cols + col0;
#pragma unroll 8
    for (int c = lane; c < cols; c += 32) cells += __ldg(row + c) & kTileAny;
  }
  cells = __reduce_add_sync(0xffffffffu, cells);
  if (lane == 0) p.block_weight[block] = cells;
}

// block_order[bh * m_blocks + rank] for the (batch, head) of this CTA, from block_weight.
template <int BM>
__global__ void __launch_bounds__(kOrderThreads)
    fwd_block_order_kernel(const __grid_constant__ FwdParams p) {
  __shared__ int bin_start[kOrderBins];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.m_blocks;
  const int* weight = p.block_weight + first;
  // The most cells a query block can visit, to spread the counts over the bins.
  const int64_t most = static_cast<int64_t>(BM / kMaskMapCell) * p.mask_map.cols;
  auto bin_of = [&](int m) {
    return static_cast<int>(static_cast<int64_t>(weight[m]) * (kOrderBins - 1) / most);
  };

  for (int i = threadIdx.x; i < kOrderBins; i += blockDim.x) bin_start[i] = 0;
  __syncthreads();
  for (int m = threadIdx.x; m < p.m_blocks; m += blockDim.x) atomicAdd(&bin_start[bin_of(m)], 1);
  __syncthreads();

  // Exclusive sum from the top bin down: bin_start[i] = blocks in the bins above i. Lane l of
  // warp 0 sums the bins kOrderBins - 1 - kPerLane * l - k, k < kPerLane.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    constexpr int kPerLane = kOrderBins / 32;
    const int top = kOrderBins - 1 - kPerLane * lane;
    int sum = 0;
    for (int k = 0; k < kPerLane; ++k) sum += bin_start[top - k];
    int before = sum;
    for (int d = 1; d < 32; d *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, before, d);
      if (lane >= d) before += x;
    }
    before -= sum;
    for (int k = 0; k < kPerLane; ++k) {
      const int count = bin_start[top - k];
      bin_start[top - k] = before;
      before += count;
    }
  }
  __syncthreads();

  int32_t* ranked = p.block_order + first;
  for (int m = threadIdx.x; m < p.m_blocks; m += blockDim.x) {
    ranked[atomicAdd(&bin_start[bin_of(m)], 1)] = m;
  }
}

}  // namespace dmattn::cuda
