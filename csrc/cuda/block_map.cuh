// Reading the mask block map (kernel_params.h: MaskBlockMap) inside the attention kernels.
//
// Finding the next non-empty tile costs a few cached byte loads per 32 tiles, looked ahead by
// each warp, instead of loading and OR-reducing every mask tile in turn (one memory round trip
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
      : MaskMapView(map, s.mask.offset(s.batch, b, h) / map.entry_elems) {}
  // The cells of entry `entry` (the mask's offset of (b, h) / entry_elems, some 140 instructions
  // of 64-bit division that a kernel may have worked out once for all its warps).
  __device__ __forceinline__ MaskMapView(const MaskBlockMap& map, int64_t entry)
      : cells(map.cells + entry * map.rows * map.cols), rows(map.rows), cols(map.cols) {}

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

// Walks the tiles t, t + kStep, ... before `end` of one row or column of tiles in order and
// finds the next one with a visible mask element. A warp loads the flags of 32 tiles at once
// and keeps them (each lane its own tile's flags, and which of the 32 have any visible
// element), so a walk waits for the map once per 32 tiles instead of at every step. Without a
// mask every tile is visible. (`has_mask`: flags_of may hide tiles; the segment ids' walks of
// segments.cuh set it with or without a mask.)
template <int kStep, typename FlagsOf>
class TileWalk {
  static_assert(kStep == 1 || kStep == -1, "walks go one tile at a time");

 public:
  __device__ __forceinline__ TileWalk(bool has_mask, FlagsOf flags_of, int end)
      : flags_of_(flags_of), has_mask_(has_mask), end_(end), base_(end) {}

  // The first tile at or after t (in walking order; t never goes back) that has kTileAny, with
  // its flags in *flags; `end` (flags 0) when there is none.
  __device__ __forceinline__ int next(int t, int* flags) {
    if (!has_mask_) {
      *flags = kTileAny | kTileAll;
      return t;
    }
    for (; before_end(t); t = base_ + 32 * kStep) {
      int offset = (t - base_) * kStep;
      if (offset < 0 || offset >= 32) {
        load(t);
        offset = 0;
      }
      const unsigned rest = any_ >> offset;
      if (rest) {
        const int first = offset + __ffs(rest) - 1;
        *flags = __shfl_sync(0xffffffffu, mine_, first);
        return base_ + first * kStep;
      }
    }
    *flags = 0;
    return end_;
  }

 private:
  __device__ __forceinline__ bool before_end(int t) const {
    return kStep > 0 ? t < end_ : t > end_;
  }
  __device__ __forceinline__ void load(int t) {
    base_ = t;
    const int tile = t + static_cast<int>(threadIdx.x & 31) * kStep;
    mine_ = before_end(tile) ? flags_of_(tile) : 0;
    any_ = __ballot_sync(0xffffffffu, (mine_ & kTileAny) != 0);
  }

  FlagsOf flags_of_;
  bool has_mask_;
  int end_;
  int base_;          // the first tile of the loaded window
  unsigned any_ = 0;  // bit i: tile base_ + i kStep has kTileAny
  int mine_ = 0;      // flags of tile base_ + lane kStep
};

// Flags of the BM x BN tiles of query rows m0.. (key block t) and of key columns n0.. (query
// block t).
template <int BM, int BN>
struct KeyTileFlags {
  MaskMapView map;
  int m0;
  __device__ __forceinline__ int operator()(int t) const { return map.tile<BM, BN>(m0, t * BN); }
};
template <int BM, int BN>
struct QueryTileFlags {
  MaskMapView map;
  int n0;
  __device__ __forceinline__ int operator()(int t) const { return map.tile<BM, BN>(t * BM, n0); }
};

// Key blocks n, n - 1, ... down to n_lo of the tiles of query rows m0.. (forward, dq kernel);
// n_lo - 1 when none is left.
template <int BM, int BN>
__device__ __forceinline__ TileWalk<-1, KeyTileFlags<BM, BN>> key_block_walk(
    const MaskMapView& map, bool has_mask, int m0, int n_lo) {
  return TileWalk<-1, KeyTileFlags<BM, BN>>(has_mask, {map, m0}, n_lo - 1);
}

// Query blocks m, m + 1, ... up to m_last of the tiles of key columns n0.. (backward); m_last +
// 1 when none is left.
template <int BM, int BN>
__device__ __forceinline__ TileWalk<1, QueryTileFlags<BM, BN>> query_block_walk(
    const MaskMapView& map, bool has_mask, int n0, int m_last) {
  return TileWalk<1, QueryTileFlags<BM, BN>>(has_mask, {map, n0}, m_last + 1);
}

}  // namespace dmattn::cuda::detail
