// Softmax-threshold skipping in the Hopper forward's consumers (kThreshold kernels; the rule:
// AttentionShape::softmax_threshold). A warpgroup's 64 rows against one key block are one block
// of the rule's grid, and the walks go up the key blocks as the rule visits them, so each
// warpgroup decides alone, right after S(n) is scored: the block is kept when some row's
// maximum there reaches the row's running log-sum-exp plus log(threshold / n_i). A dropped
// block's S is discarded (no softmax, no P V: its V slot is released unread where P V would have
// read it) and its byte of the drop map set; the map is zeroed by the launcher.
#pragma once

#include <cmath>

#include "cuda/sm90/fwd_scores.cuh"

namespace dmattn::cuda::sm90 {

// Kernels without a threshold fold every block in.
struct NoThreshold {
  template <int N>
  __device__ __forceinline__ bool folds(const float (&)[N], const RowState&, float, int,
                                        const ConsumerThread&) const {
    return true;
  }
};

// A consumer thread's view of the rule for its tile: the cut of its two rows, log2(threshold /
// n_i) with n_i the keys row i may see by position alone (rows without any never hold a visible
// score), and the drop map's row of its warpgroup's grid block (null past the last query row).
struct ThresholdRows {
  float log2_ratio[2];
  uint8_t* drops;

  // Whether block n (S in accumulator units, -inf where hidden; st: the rows' state from the
  // blocks kept so far) is folded in: kept, or holding no visible score (nothing to fold, not
  // recorded). Warpgroup-wide: every thread of the warpgroup calls it for the same block.
  template <int N>
  __device__ __forceinline__ bool folds(const float (&s)[N], const RowState& st, float mul, int n,
                                        const ConsumerThread& th) const {
    bool keep = false, seen = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float part[4];  // four chains: the decision is on the warpgroup's critical path
#pragma unroll
      for (int t = 0; t < N / 4; ++t) {
        const float pair = fmaxf(s[4 * t + 2 * half], s[4 * t + 2 * half + 1]);
        part[t % 4] = t < 4 ? pair : fmaxf(part[t % 4], pair);
      }
      float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
      float l = st.l[half];
#pragma unroll
      for (int lanes = 1; lanes <= 2; lanes *= 2) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, lanes));
        l += __shfl_xor_sync(0xffffffffu, l, lanes);
      }
      // The row's log2-sum-exp so far (units of st: exp2(acc * mul - m * mul)) plus the ratio.
      const float cut = l > 0.f ? st.m[half] * mul + __log2f(l) + log2_ratio[half] : -INFINITY;
      seen = seen || mx > -INFINITY;
      keep = keep || (mx > -INFINITY && mx * mul >= cut);
    }
    if (named_any(kVoteBarrier + th.wg, 128, keep)) return true;
    if (!named_any(kVoteBarrier + th.wg, 128, seen)) return false;
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
      const int i = th.row0(w.m0) + 8 * half;
      const int keys = i < w.lens.q_len ? min(w.lens.kv_len, i + band.dmax + 1) -
                                              max(0, i + band.dmin)
                                        : 0;
      rows.log2_ratio[half] = keys > 0 ? log2f(threshold / static_cast<float>(keys)) : 0.f;
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
