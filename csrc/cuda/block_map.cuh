// Reading the mask block map (kernel_params.h: MaskBlockMap) inside the attention kernels.
//
// Finding the next non-empty tile costs a few cached byte loads, looked ahead 32 tiles at a time
// by each warp, instead of loading and OR-reducing every mask tile in turn (one memory round trip
// and two barriers per empty tile). Every warp computes the same answer from the same bytes, so
// the walk stays CTA-uniform without a barrier.
#pragma once

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda::detail {

// The cells of the mask entry read by one (batch, query head).
struct MaskMapView {
  const uint8_t* cells;
  int rows, cols;

  __device__ __forceinline__ MaskMapView(const MaskBlockMap& map, const AttentionShape& s,
                                         int64_t b, int64_t h)
      : cells(map.cells +
              s.mask.offset(s.batch, b, h) / map.entry_elems * map.rows * map.cols),
        rows(map.rows),
        cols(map.cols) {}

  // kTileAny | kTileAll of the ROWS x COLS tile whose first element is (r0, c0).
  template <int ROWS, int COLS>
  __device__ __forceinline__ int tile(int r0, int c0) const {
    static_assert(ROWS % kMaskMapCell == 0 && COLS % kMaskMapCell == 0, "tiles cover whole cells");
    const int cr = rows == 1 ? 0 : r0 / kMaskMapCell;
    const int cc = cols == 1 ? 0 : c0 / kMaskMapCell;
    const int nr = min(rows == 1 ? 1 : ROWS / kMaskMapCell, rows - cr);
    const int nc = min(cols == 1 ? 1 : COLS / kMaskMapCell, cols - cc);
    int any = 0, all = kTileAll;
    for (int i = 0; i < nr; ++i) {
      for (int j = 0; j < nc; ++j) {
        const int f = __ldg(cells + static_cast<int64_t>(cr + i) * cols + cc + j);
        any |= f & kTileAny;
        all &= f;
      }
    }
    return any ? (any | all) : 0;
  }
};

// The first tile t, t + step, ... before `end` (exclusive; step is +1 or -1) whose
// flags_of(tile) has kTileAny; `end` when there is none. *flags receives its flags.
template <typename FlagsOf>
__device__ __forceinline__ int next_active_tile(int t, int step, int end, FlagsOf flags_of,
                                                int* flags) {
  const int lane = threadIdx.x & 31;
  for (; step > 0 ? t < end : t > end; t += 32 * step) {
    const int mine = t + lane * step;
    const int f = (step > 0 ? mine < end : mine > end) ? flags_of(mine) : 0;
    const unsigned hit = __ballot_sync(0xffffffffu, (f & kTileAny) != 0);
    if (hit) {
      const int first = __ffs(hit) - 1;
      *flags = __shfl_sync(0xffffffffu, f, first);
      return t + first * step;
    }
  }
  *flags = 0;
  return end;
}

// The key block at or below n (down to n_lo) of the BM x BN tiles of query rows m0.. that has a
// visible mask element, with its flags; n_lo - 1 when none. Without a mask: n, all true.
template <int BM, int BN>
__device__ __forceinline__ int next_key_block(const MaskMapView& map, bool has_mask, int m0,
                                              int n, int n_lo, int* flags) {
  if (!has_mask) {
    *flags = kTileAny | kTileAll;
    return n;
  }
  return next_active_tile(n, -1, n_lo - 1,
                          [&](int t) { return map.tile<BM, BN>(m0, t * BN); }, flags);
}

// The query block at or above m (up to m_last) of the BM x BN tiles of key columns n0.. that has
// a visible mask element, with its flags; m_last + 1 when none. Without a mask: m, all true.
template <int BM, int BN>
__device__ __forceinline__ int next_query_block(const MaskMapView& map, bool has_mask, int n0,
                                                int m, int m_last, int* flags) {
  if (!has_mask) {
    *flags = kTileAny | kTileAll;
    return m;
  }
  return next_active_tile(m, 1, m_last + 1,
                          [&](int t) { return map.tile<BM, BN>(t * BM, n0); }, flags);
}

}  // namespace dmattn::cuda::detail
