// The forward's drop map (softmax-threshold skipping, AttentionShape::softmax_threshold) as the
// backward kernels' walks meet it: the dropped blocks of the rule's grid for one (batch, query
// head), along one key block's column (walks over query blocks) or one row block's row (walks
// over key blocks). The walks' tiles nest in the grid's blocks.
#pragma once

#include <cstdint>

#include "common/params.h"

namespace dmattn::cuda::detail {

template <bool kByKey>
struct DropFilter {
  const uint8_t* line;  // the walked side's bytes; null: nothing is dropped
  int64_t step;         // bytes from one grid block of the walked side to the next

  // fixed_block: the grid block of the side that stays (a key block's column for walks over
  // query blocks, a row block's row for walks over key blocks).
  __device__ __forceinline__ DropFilter(const uint8_t* map, const AttentionShape& s, int64_t b,
                                        int h, int fixed_block)
      : line(map == nullptr ? nullptr
                            : map + s.drop_map_offset(b, h) +
                                  (kByKey ? fixed_block * s.skip_cols() : fixed_block)),
        step(kByKey ? 1 : s.skip_cols()) {}

  // Whether the walk's tile t (kWidth keys, kByKey, or rows wide) lies in a kept block.
  template <int kWidth>
  __device__ __forceinline__ bool keeps(int t) const {
    constexpr int kGrid = static_cast<int>(kByKey ? kSkipBlockK : kSkipBlockQ);
    static_assert(kGrid % kWidth == 0, "tiles nest in the grid's blocks");
    return line == nullptr || line[(t * kWidth / kGrid) * step] == 0;
  }

  // The first of tiles n (one the walk names), then next_visible(n -+ 1, flags)'s, ... that lies
  // in a kept block, in walking order (down by key, up by row); `end` when none is.
  template <int kWidth, typename NextVisible>
  __device__ __forceinline__ int next_kept(int n, int end, NextVisible&& next_visible,
                                           int* flags) const {
    while ((kByKey ? n > end : n < end) && !keeps<kWidth>(n)) {
      n = next_visible(kByKey ? n - 1 : n + 1, flags);
    }
    return n;
  }
};

}  // namespace dmattn::cuda::detail
