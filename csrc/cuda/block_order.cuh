// Heaviest-first order of the attention kernels' CTAs (FwdParams / BwdParams::block_order).
//
// The CTAs start in grid order, a few per SM. When the mask varies over queries and keys, the
// forward's query blocks and the backward's key blocks visit very different numbers of
// non-empty tiles (2 to 23 of 128 for a 10 % block mask), and in plain order a heavy block that
// starts in the last wave runs on while the other SMs idle (30 % of the H=2 L16k 10 % forward's
// SM time). Ranking each segment's blocks by their work, most first, lets the light ones fill in
// behind (longest processing time first). Grid order stays segment-major, so the CTAs that run
// together still share their streamed operands in L2: a forward segment is one (batch, head)
// (its K and V), a backward segment one (kv head, dk/dv class) (its Q and dO).
//
// Two small kernels (at L16k H2 about 5 us together for the forward, 9 us for the backward; their
// time is memory latency, so the counts take one warp per block): a weight kernel counts the
// non-empty mask-map cells (forward) or tiles (backward) each block visits within its visible
// range, rank_blocks_kernel sorts one segment's blocks by that count (a counting sort on
// kOrderBins bins; ties in any order). The 10 % block-mask kernels at L16k H2 Hk1: forward
// 98 -> 82 us, backward 0.446 -> 0.356 ms (tests/cuda/kernel_check --bench, side by side).
#pragma once

#include "cuda/block_map.cuh"
#include "cuda/bwd_kernel.cuh"
#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda {

constexpr int kWeightWarps = 8;
constexpr int kOrderThreads = 256;
constexpr int kOrderBins = 256;  // an approximate order is as good as an exact one
// Grids whose CTAs visit fewer tiles each run in plain order: on dynamic_attention's small
// problems (at most 12 key tiles per forward CTA, 16 query tiles per backward CTA) ordering cost
// 9-10 us per call more than it saved (H200, tests/cuda/kernel_check --bench).
constexpr int kMinOrderedTiles = 32;

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
  const int hk = h / static_cast<int>(s.num_heads / s.num_kv_heads);
  const BlockRange keys =
      visible_key_blocks<BM, BN>(L, position_rule(s, p.windows, hk), m * BM).all;
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

// block_weight[cta]: the non-empty BM x BN tiles that backward CTA `cta` (key block, kv head,
// dk/dv class in bwd_kernel's grid order) visits over all of its (batch, query head) pairs. One
// warp per CTA.
template <int BM, int BN>
__global__ void __launch_bounds__(kWeightWarps * 32)
    bwd_block_weight_kernel(const __grid_constant__ BwdParams p) {
  using namespace detail;
  const AttentionShape& s = p.s;
  const int Hk = static_cast<int>(s.num_kv_heads);
  const int G = static_cast<int>(s.num_heads / s.num_kv_heads);
  const int64_t cta = static_cast<int64_t>(blockIdx.x) * kWeightWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (cta >= p.n_blocks * static_cast<int64_t>(Hk) * p.kv_classes) return;  // whole warps only
  const int n0 = static_cast<int>(cta % p.n_blocks) * BN;
  const int hk = static_cast<int>((cta / p.n_blocks) % Hk);
  const int64_t cls = cta / p.n_blocks / Hk;
  const PositionRule rule = position_rule(s, p.windows, hk);
  int tiles = 0;
  for (int64_t pi = 0; pi < p.kv_members * G; ++pi) {
    const int64_t b = batch_of(p, cls, pi / G);
    const MaskMapView map(p.mask_map, s, b, hk * G + static_cast<int>(pi % G));
    int m_first, m_last;
    query_blocks_seeing<BM, BN>(n0, seq_lens(s, p.q_lens, p.kv_lens, b), rule, &m_first,
                                &m_last);
    for (int m = m_first + lane; m <= m_last; m += 32) {
      tiles += map.tile<BM, BN>(m * BM, n0) & kTileAny;
    }
  }
  tiles = __reduce_add_sync(0xffffffffu, tiles);
  if (lane == 0) p.block_weight[cta] = tiles;
}

// order[segment * count + rank] for the segment of this CTA: the block of each rank by
// weight[segment * count + block] (at most `most`), heaviest first, in kBins bins.
template <int kBins>
__global__ void __launch_bounds__(kOrderThreads)
    rank_blocks_kernel(const int32_t* weight, int32_t* order, int count, int64_t most) {
  static_assert(kBins % 32 == 0, "the scan gives each lane of a warp as many bins");
  __shared__ int bin_start[kBins];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * count;
  weight += first;
  auto bin_of = [&](int i) {
    return static_cast<int>(static_cast<int64_t>(weight[i]) * (kBins - 1) / most);
  };

  for (int i = threadIdx.x; i < kBins; i += blockDim.x) bin_start[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += blockDim.x) atomicAdd(&bin_start[bin_of(i)], 1);
  __syncthreads();

  // Exclusive sum from the top bin down: bin_start[i] = blocks in the bins above i. Lane l of
  // warp 0 sums the bins kBins - 1 - kPerLane * l - k, k < kPerLane.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    constexpr int kPerLane = kBins / 32;
    const int top = kBins - 1 - kPerLane * lane;
    int sum = 0;
    for (int k = 0; k < kPerLane; ++k) sum += bin_start[top - k];
    int before = sum;
    for (int d = 1; d < 32; d *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, before, d);
      if (lane >= d) before += x;
    }
    before -= sum;
    for (int k = 0; k < kPerLane; ++k) {
      const int n = bin_start[top - k];
      bin_start[top - k] = before;
      before += n;
    }
  }
  __syncthreads();

  int32_t* ranked = order + first;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    ranked[atomicAdd(&bin_start[bin_of(i)], 1)] = i;
  }
}

}  // namespace dmattn::cuda
