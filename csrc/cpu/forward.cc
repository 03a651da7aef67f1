// Forward: out, lse <- softmax(scale·q·kᵀ + bias, masked) · v, one task per (batch, head,
// query block), an online softmax over the visible key tiles. With a softmax threshold, one task
// per (batch, head, kSkipBlockQ rows) walks the kSkipBlockK-key blocks in increasing key order,
// deciding each block from all its tiles' scores before any of them enters the softmax
// (common/params.h: softmax_threshold), and records the dropped blocks.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/attention.h"
#include "cpu/element_types.h"
#include "cpu/fast_math.h"
#include "cpu/gemm.h"
#include "cpu/scores.h"
#include "cpu/scratch.h"
#include "cpu/simd.h"
#include "cpu/tile_loads.h"
#include "cpu/tiles.h"

namespace dmattn::cpu {
namespace {

// A task's fp32 tiles; dp is the padded head dim.
struct ForwardTiles {
  explicit ForwardTiles(int64_t dp)
      : q(AllocateFloats(kBlockM * dp)),
        kt(AllocateFloats(dp * kBlockN)),
        v(AllocateFloats(kBlockN * dp)),
        s(AllocateFloats(kBlockM * kBlockN)),
        o(AllocateFloats(kBlockM * dp)),
        row_max(AllocateFloats(kBlockM)),
        row_sum(AllocateFloats(kBlockM)) {}
  FloatBuffer q;   // [kBlockM][dp], multiplied by the scale
  FloatBuffer kt;  // [dp][kBlockN]
  FloatBuffer v;   // [kBlockN][dp]
  FloatBuffer s;   // [kBlockM][kBlockN]: scores, then exp(score - running max)
  FloatBuffer o;   // [kBlockM][dp]: unnormalised output
  FloatBuffer row_max, row_sum;
};

// One online-softmax step: folds the tile's scores (turned into exp(s - running max) in place)
// into the running max and sum of each row, rescaling the output rows accumulated so far.
// `scores`: the tile's scores (tiles.s by default).
void OnlineSoftmaxStep(const Tile& t, int64_t dp, ForwardTiles& tiles, float* scores = nullptr) {
  const int64_t cols = t.padded_cols();
  if (scores == nullptr) scores = tiles.s.get();
  for (int64_t r = 0; r < t.padded_rows(); ++r) {
    float* __restrict p = scores + r * kBlockN;
    const float old_max = tiles.row_max[r];
    const float new_max = std::fmax(old_max, RowMax(p, cols));
    // While a row has seen no visible key its max is -inf; shifting by 0 then keeps every exp()
    // at exactly 0 instead of computing -inf - -inf = NaN.
    const float shift = new_max == -INFINITY ? 0.f : new_max;
    const float alpha = FastExp(old_max - shift);  // 0 when the old max was -inf
    for (int64_t c = 0; c < cols; ++c) p[c] = FastExp(p[c] - shift);
    tiles.row_sum[r] = tiles.row_sum[r] * alpha + RowSum(p, cols);
    tiles.row_max[r] = new_max;
    if (alpha != 1.f) {
      float* __restrict o = tiles.o.get() + r * dp;
      for (int64_t d = 0; d < dp; ++d) o[d] *= alpha;
    }
  }
}

// An item's operands: its mask and bias at its (row 0, col 0), null when absent; its k and v.
template <typename T>
struct ItemOperands {
  const bool* mask;
  const T* bias;
  const T* k;
  const T* v;
  ItemOperands(const ForwardArgs& args, const HeadItem& item)
      : mask(args.mask != nullptr ? args.mask + item.mask_offset : nullptr),
        bias(args.bias != nullptr ? static_cast<const T*>(args.bias) + item.bias_offset
                                  : nullptr),
        k(static_cast<const T*>(args.k) + item.kv_offset),
        v(static_cast<const T*>(args.v) + item.kv_offset) {}
};

// Runs the online softmax of the query block over every key tile with a visible key.
template <typename T>
void AttendToVisibleKeys(const AttentionShape& shape, const ForwardArgs& args,
                         const HeadItem& item, int64_t qb, ForwardTiles& tiles) {
  const int64_t dim = shape.head_dim, dp = PaddedHeadDim(shape);
  const int64_t kv_stride = shape.kv_row_stride();
  const ItemOperands<T> in(args, item);
  const bool* mask = in.mask;
  const T *bias = in.bias, *k = in.k, *v = in.v;

  const Tile block = MakeTile(item, qb, 0);
  const Range keys = VisibleKeysOfRows(shape, item, block.i0, block.rows);
  const int64_t kb_end = keys.empty() ? 0 : NumBlocks(keys.end, kBlockN);
  for (int64_t kb = keys.begin / kBlockN; kb < kb_end; ++kb) {
    const Tile t = MakeTile(item, qb, kb);
    if (!TileHasVisibleKey(shape, item, mask, t)) continue;
    const int64_t first = KeyTileRow(shape, item, t.j0) * kv_stride;
    LoadTransposed(k + first, kv_stride, t.cols, dim, tiles.kt.get(), kBlockN, t.padded_cols());
    LoadRows(v + first, kv_stride, t.cols, dim, 1.f, tiles.v.get(), dp, t.cols);
    ComputeScores(shape, item, mask, bias, t, tiles.q.get(), dp, tiles.kt.get(), tiles.s.get(),
                  nullptr);
    OnlineSoftmaxStep(t, dp, tiles);
    GemmAccumulate(t.padded_rows(), dp, t.cols, tiles.s.get(), kBlockN, 1, tiles.v.get(), dp,
                   tiles.o.get(), dp);
  }
}

// Writes every row of the block: rows with no visible key (row_sum 0, including rows past q_len)
// get out = 0 and lse = -inf.
template <typename T>
void WriteRows(const AttentionShape& shape, const ForwardArgs& args, const HeadItem& item,
               const Tile& block, const ForwardTiles& tiles) {
  const int64_t dim = shape.head_dim, dp = PaddedHeadDim(shape);
  const int64_t q_stride = shape.q_row_stride();
  const int64_t out_offset = item.q_offset + block.i0 * q_stride;
  float* lse = args.lse + item.lse_offset + block.i0;
  const int64_t block_rows = std::min(kBlockM, shape.seqlen_q - block.i0);
  for (int64_t r = 0; r < block_rows; ++r) {
    const float sum = tiles.row_sum[r];
    const float* o = tiles.o.get() + r * dp;
    for (int64_t d = 0; d < dim; ++d) {
      const float x = sum > 0.f ? o[d] / sum : 0.f;
      const int64_t at = out_offset + r * q_stride + d;
      if (args.out_f32) {
        static_cast<float*>(args.out)[at] = x;
      } else {
        static_cast<T*>(args.out)[at] = FromFloat<T>(x);
      }
    }
    lse[r] = sum > 0.f ? tiles.row_max[r] + std::log(sum) : -INFINITY;
  }
}

// Zeroes the running state and loads the (scaled) query rows of `block`.
template <typename T>
void BeginRows(const AttentionShape& shape, const ForwardArgs& args, const HeadItem& item,
               const Tile& block, ForwardTiles& tiles) {
  const int64_t dp = PaddedHeadDim(shape), q_stride = shape.q_row_stride();
  std::fill(tiles.row_max.get(), tiles.row_max.get() + kBlockM, -INFINITY);
  std::fill(tiles.row_sum.get(), tiles.row_sum.get() + kBlockM, 0.f);
  std::fill(tiles.o.get(), tiles.o.get() + kBlockM * dp, 0.f);
  if (block.rows > 0)
    LoadRows(static_cast<const T*>(args.q) + item.q_offset + block.i0 * q_stride, q_stride,
             block.rows, shape.head_dim, shape.scale, tiles.q.get(), dp, block.padded_rows());
}

template <typename T>
void ForwardTask(const AttentionShape& shape, const ForwardArgs& args, int64_t b, int64_t h,
                 int64_t qb) {
  const HeadItem item = MakeHeadItem(shape, args, b, h);
  const int64_t dp = PaddedHeadDim(shape);
  const Tile block = MakeTile(item, qb, 0);  // its rows; the keys vary per tile

  ForwardTiles tiles(dp);
  BeginRows<T>(shape, args, item, block, tiles);
  if (block.rows > 0) AttendToVisibleKeys<T>(shape, args, item, qb, tiles);

  WriteRows<T>(shape, args, item, block, tiles);
}

// Softmax-threshold skipping (common/params.h: softmax_threshold): the kSkipBlockQ rows `sb` of
// one item, as kHalves query tiles in lockstep over the kSkipBlockK-key blocks in increasing key
// order. A block's visible tiles are all scored first; the block is dropped (no V load, no P·V,
// not folded into the running max and sum) when no row of it has a visible score at or above
// running_lse_i + log(threshold / n_i), else its tiles enter the online softmax in key order.
template <typename T>
void SkipForwardTask(const AttentionShape& shape, const ForwardArgs& args, int64_t b, int64_t h,
                     int64_t sb) {
  constexpr int64_t kHalves = kSkipBlockQ / kBlockM, kParts = kSkipBlockK / kBlockN;
  const HeadItem item = MakeHeadItem(shape, args, b, h);
  const int64_t dim = shape.head_dim, dp = PaddedHeadDim(shape);
  const int64_t kv_stride = shape.kv_row_stride();
  const ItemOperands<T> in(args, item);
  const bool* mask = in.mask;
  const T *bias = in.bias, *k = in.k, *v = in.v;
  uint8_t* drops = args.drop_map + shape.drop_map_offset(b, h) + sb * shape.skip_cols();
  std::fill_n(drops, shape.skip_cols(), uint8_t{0});

  std::vector<ForwardTiles> tiles;
  std::vector<FloatBuffer> scores, kt, vt;
  Tile rows[kHalves];
  float log_ratio[kHalves][kBlockM];  // log(threshold / n_i), rows with n_i > 0
  Range keys;
  bool any_keys = false;
  for (int64_t half = 0; half < kHalves; ++half) {
    tiles.emplace_back(dp);
    rows[half] = MakeTile(item, sb * kHalves + half, 0);
    BeginRows<T>(shape, args, item, rows[half], tiles[half]);
    for (int64_t r = 0; r < rows[half].rows; ++r) {
      const int64_t n = PositionalKeyCount(shape, item, rows[half].i0 + r);
      log_ratio[half][r] =
          n > 0 ? static_cast<float>(std::log(shape.softmax_threshold / static_cast<double>(n)))
                : 0.f;
    }
    const Range r = VisibleKeysOfRows(shape, item, rows[half].i0, rows[half].rows);
    if (r.empty()) continue;
    keys.begin = any_keys ? std::min(keys.begin, r.begin) : r.begin;
    keys.end = any_keys ? std::max(keys.end, r.end) : r.end;
    any_keys = true;
  }
  for (int64_t n = 0; n < kHalves * kParts; ++n)
    scores.push_back(AllocateFloats(kBlockM * kBlockN));
  for (int64_t p = 0; p < kParts; ++p) {
    kt.push_back(AllocateFloats(dp * kBlockN));
    vt.push_back(AllocateFloats(kBlockN * dp));
  }

  const int64_t sk_end = any_keys ? NumBlocks(keys.end, kSkipBlockK) : 0;
  for (int64_t sk = any_keys ? keys.begin / kSkipBlockK : 0; sk < sk_end; ++sk) {
    bool visible[kHalves][kParts] = {};
    bool any_visible = false;
    for (int64_t p = 0; p < kParts; ++p) {
      bool loaded = false;
      for (int64_t half = 0; half < kHalves; ++half) {
        const Tile t = MakeTile(item, sb * kHalves + half, sk * kParts + p);
        if (!TileHasVisibleKey(shape, item, mask, t)) continue;
        if (!loaded) {
          LoadTransposed(k + t.j0 * kv_stride, kv_stride, t.cols, dim, kt[p].get(), kBlockN,
                         t.padded_cols());
          loaded = true;
        }
        ComputeScores(shape, item, mask, bias, t, tiles[half].q.get(), dp, kt[p].get(),
                      scores[half * kParts + p].get(), nullptr);
        visible[half][p] = any_visible = true;
      }
    }
    if (!any_visible) continue;
    // The decision: does some row hold a visible score at or above its cut? A block whose
    // visible scores are all -inf (a -inf bias) weighs nothing and holds no visible pair for
    // the rule (reference.softmax_skip_blocks looks at scores above -inf): never recorded.
    bool keep = false, any_finite = false;  // any score not -inf
    for (int64_t half = 0; half < kHalves && !keep; ++half) {
      const ForwardTiles& state = tiles[half];
      for (int64_t r = 0; r < rows[half].rows && !keep; ++r) {
        const float sum = state.row_sum[r];
        const float cut =
            sum > 0.f ? state.row_max[r] + std::log(sum) + log_ratio[half][r] : -INFINITY;
        for (int64_t p = 0; p < kParts && !keep; ++p) {
          if (!visible[half][p]) continue;
          const Tile t = MakeTile(item, sb * kHalves + half, sk * kParts + p);
          const float* srow = scores[half * kParts + p].get() + r * kBlockN;
          for (int64_t c = 0; c < t.cols; ++c) {
            if (srow[c] != -INFINITY) {  // NaN counts (and is dropped, as before)
              any_finite = true;
              if (srow[c] >= cut) {
                keep = true;
                break;
              }
            }
          }
        }
      }
    }
    if (!any_finite) continue;  // nothing to fold in: exp(-inf) = 0
    if (!keep) {
      drops[sk] = 1;
      continue;
    }
    for (int64_t p = 0; p < kParts; ++p) {
      bool loaded = false;
      for (int64_t half = 0; half < kHalves; ++half) {
        if (!visible[half][p]) continue;
        const Tile t = MakeTile(item, sb * kHalves + half, sk * kParts + p);
        if (!loaded) {
          LoadRows(v + t.j0 * kv_stride, kv_stride, t.cols, dim, 1.f, vt[p].get(), dp, t.cols);
          loaded = true;
        }
        float* s = scores[half * kParts + p].get();
        OnlineSoftmaxStep(t, dp, tiles[half], s);
        GemmAccumulate(t.padded_rows(), dp, t.cols, s, kBlockN, 1, vt[p].get(), dp,
                       tiles[half].o.get(), dp);
      }
    }
  }
  for (int64_t half = 0; half < kHalves; ++half) {
    if (rows[half].i0 < shape.seqlen_q) WriteRows<T>(shape, args, item, rows[half], tiles[half]);
  }
}

}  // namespace

void Forward(const AttentionShape& shape, const ForwardArgs& args,
             const ParallelFor& parallel_for) {
  const int64_t items = shape.batch_count() * shape.num_heads;
  const int64_t q_blocks = NumBlocks(shape.seqlen_q, kBlockM);
  DispatchElementType(shape.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (shape.softmax_threshold > 0.0) {
      const int64_t skip_rows = shape.skip_rows();
      parallel_for(items * skip_rows, [&](int64_t task) {
        const int64_t sb = skip_rows - 1 - task / items, item = task % items;
        SkipForwardTask<T>(shape, args, item / shape.num_heads, item % shape.num_heads, sb);
      });
      return;
    }
    // Last query blocks first: under a causal rule they see the most keys, and starting the
    // longest tasks first shortens the tail.
    parallel_for(items * q_blocks, [&](int64_t task) {
      const int64_t qb = q_blocks - 1 - task / items, item = task % items;
      ForwardTask<T>(shape, args, item / shape.num_heads, item % shape.num_heads, qb);
    });
  });
}

}  // namespace dmattn::cpu
