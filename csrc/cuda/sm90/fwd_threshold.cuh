// Softmax-threshold skipping in the Hopper forward's consumers (kThreshold kernels; the rule:
// AttentionShape::softmax_threshold). A warpgroup's 64 rows against one key block are one block
// of the rule's grid, and the walks go up the key blocks as the rule visits them, so each
// warpgroup decides alone, right after S(n) is scored: the block is kept when some row's
// maximum there reaches the row's running log-sum-exp plus log(threshold / n_i). A dropped
// block's S is discarded (no softmax, no P V: its V slot is released unread where P V would have
// read it) and its byte of the drop map set; the map is zeroed by the launcher.
#pragma once

#include "cuda/sm90/fwd_scores.cuh"
#include "cuda/threshold.cuh"

namespace dmattn::cuda::sm90 {

// Kernels without a threshold fold every block in.
struct NoThreshold {
  template <int N>
  __device__ __forceinline__ bool folds(const float (&)[N], const RowState&, float, int,
                                        const ConsumerThread&) const {
    return true;
  }
};

// A consumer thread's view of the rule for its tile: log2(threshold / n_i) of its two rows
// (threshold.cuh) and the drop map's row of its warpgroup's grid block (null past the last query
// row).
struct ThresholdRows {
  float log2_ratio[2];
  uint8_t* drops;

  // Whether block n (S in accumulator units, -inf where hidden; st: the rows' state from the
  // blocks kept so far) is folded in: kept, or holding no visible score (nothing to fold, not
  // recorded). Warpgroup-wide: every thread of the warpgroup calls it for the same block.
  template <int N>
  __device__ __forceinline__ bool folds(const float (&s)[N], const RowState& st, float mul, int n,
                                        const ConsumerThread& th) const {
    const detail::RowVerdict v = detail::row_verdict(s, st.m, st.l, log2_ratio, mul);
    if (named_any(kVoteBarrier + th.wg, 128, v.keep)) return true;
    if (!named_any(kVoteBarrier + th.wg, 128, v.seen)) return false;
    if (drops != nullptr && th.warp == 0 && th.lane == 0) drops[n] = 1;
    return false;
  }
};

template <typename Tr>
__device__ __forceinline__ auto threshold_rows(const FwdParamsSm90& P, const TileWork& w,
                                               const ConsumerThread& th) {
  if constexpr (Tr::kThreshold) {
    const AttentionShape& s = P.p.s;
    const detail::Band band = head_rule<Tr>(P, w.hk).band;
    const float threshold = static_cast<float>(s.softmax_threshold);
    ThresholdRows rows;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rows.log2_ratio[half] =
          detail::threshold_log2_ratio(threshold, th.row0(w.m0) + 8 * half, w.lens, band);
    }
    const int grid_row = th.wg_row0(w.m0) / static_cast<int>(kSkipBlockQ);
    rows.drops = grid_row < s.skip_rows()
                     ? P.p.drop_map + s.drop_map_offset(w.b, w.h) + grid_row * s.skip_cols()
                     : nullptr;
    return rows;
  } else {
    return NoThreshold{};
  }
}

}  // namespace dmattn::cuda::sm90
