// Tile geometry, visibility and the score tile shared by the forward and both backward passes.
//
// A tile is kBlockM query rows × kBlockN keys of one (batch, head) item. Everything here is
// computed the same way in every pass, so the backward recomputes exactly the forward's scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "cpu/element_types.h"
#include "cpu/fast_math.h"
#include "cpu/gemm.h"
#include "cpu/simd.h"

namespace dmattn::cpu {

constexpr int64_t kBlockM = 64;  // query rows per tile
constexpr int64_t kBlockN = 64;  // keys per tile; also the row stride of score tiles

inline int64_t NumBlocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Row stride of fp32 Q/K/V/O tiles: D rounded up to whole vectors, the padding kept at zero.
inline int64_t PaddedHeadDim(const AttentionShape& shape) {
  return RoundUp(shape.head_dim, kVecWidth);
}

// One (flat batch b, query head h): its visible lengths and where its operands start.
struct HeadItem {
  int64_t q_len = 0, kv_len = 0;  // queries >= q_len and keys >= kv_len are invisible
  int64_t q_offset = 0;           // q, out, dout, dq
  int64_t kv_offset = 0;          // k, v, dk, dv
  int64_t lse_offset = 0;         // lse, dlse, softmax_d
  int64_t mask_offset = 0, bias_offset = 0;
};

inline HeadItem MakeHeadItem(const AttentionShape& shape, const int32_t* q_lens,
                             const int32_t* kv_lens, int64_t b, int64_t h) {
  HeadItem item;
  item.q_len = shape.seqlen_q;
  item.kv_len = shape.seqlen_k;
  if (shape.has_seqlens) {
    const int64_t at = shape.seqlens_batch.offset(shape.batch, b);
    if (q_lens) item.q_len = std::clamp<int64_t>(q_lens[at], 0, shape.seqlen_q);
    if (kv_lens) item.kv_len = std::clamp<int64_t>(kv_lens[at], 0, shape.seqlen_k);
  }
  item.q_offset = shape.q_offset(b, h);
  item.kv_offset = shape.kv_offset(b, h / shape.heads_per_kv_head());
  item.lse_offset = shape.lse_offset(b, h);
  if (shape.mask.present) item.mask_offset = shape.mask.offset(shape.batch, b, h);
  if (shape.bias.present) item.bias_offset = shape.bias.offset(shape.batch, b, h);
  return item;
}

// The visible part of one tile: rows below q_len, keys below kv_len.
struct Tile {
  int64_t i0 = 0, rows = 0;  // query rows [i0, i0 + rows)
  int64_t j0 = 0, cols = 0;  // keys [j0, j0 + cols)
  // The extent the GEMMs compute over (kept finite, scores -inf outside rows × cols).
  int64_t padded_rows() const { return RoundUp(rows, kGemmRows); }
  int64_t padded_cols() const { return RoundUp(cols, kVecWidth); }
};

inline Tile MakeTile(const HeadItem& item, int64_t qb, int64_t kb) {
  Tile t;
  t.i0 = qb * kBlockM;
  t.rows = std::clamp<int64_t>(item.q_len - t.i0, 0, kBlockM);
  t.j0 = kb * kBlockN;
  t.cols = std::clamp<int64_t>(item.kv_len - t.j0, 0, kBlockN);
  return t;
}

// A half-open range [begin, end); empty when begin >= end.
struct Range {
  int64_t begin = 0, end = 0;
  bool empty() const { return begin >= end; }
};

// Keys that the diagonal/window rule and kv_len leave visible to query i.
inline Range VisibleKeys(const AttentionShape& shape, int64_t i, int64_t kv_len) {
  return Range{shape.first_visible_key(i), shape.end_visible_key(i, kv_len)};
}

// Keys visible to at least one of the rows [i0, i0 + rows). Both ends of a row's range move right
// by at most one key per row, so the non-empty ranges overlap and their union is one range.
inline Range VisibleKeysOfRows(const AttentionShape& shape, int64_t i0, int64_t rows,
                               int64_t kv_len) {
  Range all;
  bool any = false;
  for (int64_t i = i0; i < i0 + rows; ++i) {
    const Range r = VisibleKeys(shape, i, kv_len);
    if (r.empty()) continue;
    if (!any) all.begin = r.begin;
    all.end = r.end;
    any = true;
  }
  return any ? all : Range{};
}

// Row r's visible keys in tile coordinates (within [0, t.cols)), by the diagonal/window rule.
inline Range RowVisibleCols(const AttentionShape& shape, const HeadItem& item, const Tile& t,
                            int64_t r) {
  const Range keys = VisibleKeys(shape, t.i0 + r, item.kv_len);
  return Range{std::clamp<int64_t>(keys.begin - t.j0, 0, t.cols),
               std::clamp<int64_t>(keys.end - t.j0, 0, t.cols)};
}

// Start of row r, column 0 of the tile in a mask or bias (or dbias) of this item.
template <typename T>
inline const T* OperandRow(const T* item_base, const BroadcastOperand& op, const Tile& t,
                           int64_t r) {
  return item_base + (t.i0 + r) * op.row_stride + t.j0 * op.col_stride;
}

// OR of mask row entries [lo, hi) (mask_row points at column 0 of the tile).
inline bool MaskRowAny(const bool* mask_row, int64_t col_stride, Range cols) {
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask_row);
  uint8_t any = 0;
  if (col_stride == 1) {
    for (int64_t c = cols.begin; c < cols.end; ++c) any |= m[c];
  } else {
    for (int64_t c = cols.begin; c < cols.end; ++c) any |= m[c * col_stride];
  }
  return any != 0;
}

// Whether any (row, key) of the tile is visible: the diagonal/window rule first, then an OR over
// the mask entries it leaves (upstream's __syncthreads_or). A false answer means the tile is
// skipped: no K/V/bias loads, no math. item_mask is null when there is no mask.
inline bool TileHasVisibleKey(const AttentionShape& shape, const HeadItem& item,
                              const bool* item_mask, const Tile& t) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const Range cols = RowVisibleCols(shape, item, t, r);
    if (cols.empty()) continue;
    if (item_mask == nullptr) return true;
    if (MaskRowAny(OperandRow(item_mask, shape.mask, t, r), shape.mask.col_stride, cols))
      return true;
  }
  return false;
}

// dst[r][d] = scale * src[r][d] for r < rows, d < dim (src rows src_stride apart); zeros in the
// rest of the padded_rows × ld tile.
template <typename T>
void LoadRows(const T* src, int64_t src_stride, int64_t rows, int64_t dim, float scale,
              float* dst, int64_t ld, int64_t padded_rows) {
  for (int64_t r = 0; r < padded_rows; ++r) {
    float* __restrict d = dst + r * ld;
    int64_t c = 0;
    if (r < rows) {
      const T* __restrict s = src + r * src_stride;
      for (; c < dim; ++c) d[c] = scale * ToFloat(s[c]);
    }
    for (; c < ld; ++c) d[c] = 0.f;
  }
}

// dst[d][c] = src[c][d] for c < cols, d < dim (a K or V tile stored key-minor, so that score
// rows are axpy loops over contiguous keys); zeros for c in [cols, padded_cols).
template <typename T>
void LoadTransposed(const T* src, int64_t src_stride, int64_t cols, int64_t dim, float* dst,
                    int64_t ld, int64_t padded_cols) {
  for (int64_t c = 0; c < cols; ++c) {
    const T* __restrict s = src + c * src_stride;
    for (int64_t d = 0; d < dim; ++d) dst[d * ld + c] = ToFloat(s[d]);
  }
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t c = cols; c < padded_cols; ++c) dst[d * ld + c] = 0.f;
}

// The tile's scores s[r][c] (row stride kBlockN) over t.padded_rows() × t.padded_cols():
// bias + q·kᵀ (q already multiplied by the scale), softcapped, then -inf where the key is not
// visible to the row. With softcap on and cap_grad not null, cap_grad[r][c] receives the softcap's
// derivative 1 - tanh². item_mask / item_bias point at this item's (row 0, col 0), or are null.
template <typename T>
void ComputeScores(const AttentionShape& shape, const HeadItem& item, const bool* item_mask,
                   const T* item_bias, const Tile& t, const float* q, int64_t q_ld,
                   const float* kt, float* s, float* cap_grad) {
  const int64_t rows = t.padded_rows(), cols = t.padded_cols();
  // The accumulator starts from the bias tile, so the product adds onto it.
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict srow = s + r * kBlockN;
    int64_t c = 0;
    if (item_bias != nullptr && r < t.rows) {
      const T* __restrict b = OperandRow(item_bias, shape.bias, t, r);
      const int64_t stride = shape.bias.col_stride;
      if (stride == 1) {
        for (; c < t.cols; ++c) srow[c] = ToFloat(b[c]);
      } else {
        for (; c < t.cols; ++c) srow[c] = ToFloat(b[c * stride]);
      }
    }
    for (; c < cols; ++c) srow[c] = 0.f;
  }
  GemmAccumulate(rows, cols, shape.head_dim, q, q_ld, 1, kt, kBlockN, s, kBlockN);

  if (shape.softcap > 0.f) {
    const float cap = shape.softcap, inv_cap = 1.f / shape.softcap;
    for (int64_t r = 0; r < rows; ++r) {
      float* __restrict srow = s + r * kBlockN;
      float* __restrict grow = cap_grad != nullptr ? cap_grad + r * kBlockN : nullptr;
      for (int64_t c = 0; c < cols; ++c) {
        const float th = FastTanh(srow[c] * inv_cap);
        srow[c] = cap * th;
        if (grow != nullptr) grow[c] = 1.f - th * th;
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict srow = s + r * kBlockN;
    const Range vis = r < t.rows ? RowVisibleCols(shape, item, t, r) : Range{};
    for (int64_t c = 0; c < cols; ++c)
      srow[c] = (c >= vis.begin && c < vis.end) ? srow[c] : -INFINITY;
    if (item_mask == nullptr || vis.empty()) continue;
    const bool* m = OperandRow(item_mask, shape.mask, t, r);
    const int64_t stride = shape.mask.col_stride;
    if (stride == 1) {
      for (int64_t c = vis.begin; c < vis.end; ++c) srow[c] = m[c] ? srow[c] : -INFINITY;
    } else {
      for (int64_t c = vis.begin; c < vis.end; ++c)
        srow[c] = m[c * stride] ? srow[c] : -INFINITY;
    }
  }
}

}  // namespace dmattn::cpu
