// Tile geometry and visibility, shared by the forward and both backward passes.
//
// A tile is kBlockM query rows × kBlockN keys of one (batch, head) item. Which tiles are skipped
// and which scores are hidden is decided here alone, so every pass agrees.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/params.h"
#include "cpu/gemm.h"
#include "cpu/simd.h"

namespace dmattn::cpu {

constexpr int64_t kBlockM = 64;  // query rows per tile
constexpr int64_t kBlockN = 64;  // keys per tile; also the row stride of score tiles
// Each tile lies in one block of the gate threshold's grid (common/params.h), so a tile is
// skipped exactly when its block is dropped: no tile ever holds dropped and kept blocks.
static_assert(kGateBlockQ % kBlockM == 0 && kGateBlockK % kBlockN == 0,
              "CPU tiles must nest in the gate grid");
// Likewise for softmax-threshold skipping's grid: the forward decides a whole block from its
// kSkipBlockQ / kBlockM × kSkipBlockK / kBlockN tiles, the backward skips a tile by its block.
static_assert(kSkipBlockQ % kBlockM == 0 && kSkipBlockK % kBlockN == 0,
              "CPU tiles must nest in the softmax-threshold grid");
// A key tile of a paged cache lies in one page, so its rows are kv_row_stride apart.
static_assert(kMinPageSize % kBlockN == 0, "CPU key tiles must nest in a cache's pages");

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
  // The item's segment ids (query i sees key j only where they are equal), or null.
  const int32_t* q_segments = nullptr;  // [Lq]
  const int32_t* kv_segments = nullptr;  // [Lk]
  // The item's key ranges (key j is visible to rows [key_start[j], key_end[j])), or null.
  const int32_t* key_start = nullptr;  // [Lk]
  const int32_t* key_end = nullptr;    // [Lk]
  // The item's row ranges (row i sees keys [row_start[i], row_end[i])), or null.
  const int32_t* row_start = nullptr;  // [Lq]
  const int32_t* row_end = nullptr;    // [Lq]
  // The item's block indices (query block n sees the key blocks block_indices[n * K + 0..K)),
  // or null.
  const int32_t* block_indices = nullptr;  // [ceil(Lq / block_q), K]
  // The item's kv head window (its row of shape.head_windows): keys [0, sink) and the band
  // [i + diagonal_offset - left, i + diagonal_offset + right] (a bound < 0 unbounded), on top of
  // the shape's own window; head_window false without a table.
  bool head_window = false;
  int64_t sink = 0, left = -1, right = -1;
  // The item's gate (row i's alpha at alpha[i * num_heads], key j's delta at
  // delta[j * num_kv_heads]), or null.
  const float* alpha = nullptr;
  const float* delta = nullptr;
  // The blocks the forward's softmax threshold dropped (this item's [ceil(Lq / kSkipBlockQ),
  // ceil(Lk / kSkipBlockK)] rows of the drop map), in the backward only; else null.
  const uint8_t* drop_map = nullptr;
  // The item's row of a paged cache's page table (common/params.h: KvPages), or null.
  const int32_t* page_table = nullptr;
};

// Args: ForwardArgs or BackwardArgs (their lengths, segment ids, key and row ranges, block
// indices, gate).
template <typename Args>
HeadItem MakeHeadItem(const AttentionShape& shape, const Args& args, int64_t b, int64_t h) {
  HeadItem item;
  item.q_len = shape.seqlen_q;
  item.kv_len = shape.seqlen_k;
  if (shape.has_seqlens) {
    const int64_t at = shape.seqlens_batch.offset(shape.batch, b);
    if (args.q_lens) item.q_len = std::clamp<int64_t>(args.q_lens[at], 0, shape.seqlen_q);
    if (args.kv_lens) item.kv_len = std::clamp<int64_t>(args.kv_lens[at], 0, shape.seqlen_k);
  }
  if (shape.has_segments) {
    const int64_t row = shape.segments_batch.offset(shape.batch, b);
    item.q_segments = args.q_segments + row * shape.seqlen_q;
    item.kv_segments = args.kv_segments + row * shape.seqlen_k;
  }
  if (shape.key_ranges.present) {
    const int64_t at = shape.key_ranges.offset(shape.batch, b, h);
    item.key_start = args.key_start + at;
    item.key_end = args.key_end + at;
  }
  if (shape.row_ranges.present) {
    const int64_t at = shape.row_ranges.offset(shape.batch, b, h);
    item.row_start = args.row_start + at;
    item.row_end = args.row_end + at;
  }
  if (shape.block_indices.present) {
    item.block_indices = args.block_indices + shape.block_indices.offset(shape.batch, b, h);
  }
  if (shape.head_windows != nullptr) {
    const int64_t* row = shape.head_windows + 3 * (h / shape.heads_per_kv_head());
    item.head_window = true;
    item.sink = row[0];
    item.left = row[1];
    item.right = row[2];
  }
  if (shape.has_gate) {
    item.alpha = args.alpha + shape.alpha_offset(b, h);
    item.delta = args.delta + shape.delta_offset(b, h / shape.heads_per_kv_head());
  }
  if constexpr (std::is_same_v<Args, BackwardArgs>) {
    if (args.drop_map != nullptr) item.drop_map = args.drop_map + shape.drop_map_offset(b, h);
  } else if (shape.pages.present()) {
    item.page_table = shape.pages.table_row(args.page_table, shape.batch, b);
  }
  item.q_offset = shape.q_offset(b, h);
  item.kv_offset = shape.kv_offset(b, h / shape.heads_per_kv_head());
  item.lse_offset = shape.lse_offset(b, h);
  if (shape.mask.present) item.mask_offset = shape.mask.offset(shape.batch, b, h);
  if (shape.bias.present) item.bias_offset = shape.bias.offset(shape.batch, b, h);
  return item;
}

// The row of k and v (counted from the item's kv_offset in kv_row_stride steps) where the key
// tile starting at j0 starts: j0, or its row in a paged cache's pool.
inline int64_t KeyTileRow(const AttentionShape& shape, const HeadItem& item, int64_t j0) {
  return item.page_table != nullptr ? shape.pages.key_row(item.page_table, j0) : j0;
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

// The keys one row may see by the diagonal/window rule, kv_len and its kv head's window: `low`
// and `high`, disjoint, low before high; high is empty unless a sink and a band are apart.
struct RowKeys {
  Range low, high;
  bool empty() const { return low.empty() && high.empty(); }
  // The smallest range holding both.
  Range hull() const {
    if (high.empty()) return low;
    return low.empty() ? high : Range{low.begin, high.end};
  }
};

// Keys visible to query i. Without a head window, one range; with one, the shape's range cut to
// the sink [0, sink) and to the head's band, which are one range where they meet.
inline RowKeys VisibleKeys(const AttentionShape& shape, const HeadItem& item, int64_t i) {
  const Range all{shape.first_visible_key(i), shape.end_visible_key(i, item.kv_len)};
  if (!item.head_window || all.empty()) return RowKeys{all, Range{}};
  const int64_t diagonal = i + shape.diagonal_offset;
  const Range sink{all.begin, std::min(all.end, item.sink)};
  Range band = all;
  if (item.left >= 0) band.begin = std::max(band.begin, diagonal - item.left);
  if (item.right >= 0) band.end = std::min(band.end, diagonal + item.right + 1);
  if (sink.empty()) return RowKeys{band, Range{}};
  if (band.empty()) return RowKeys{sink, Range{}};
  // sink.begin <= band.begin (both start at or after all.begin, the sink exactly there).
  if (band.begin <= sink.end) return RowKeys{Range{sink.begin, std::max(sink.end, band.end)}, {}};
  return RowKeys{sink, band};
}

// Keys visible to at least one of the rows [i0, i0 + rows), as one range (the hull of the rows'
// keys; tiles inside it that no row sees are skipped tile by tile).
inline Range VisibleKeysOfRows(const AttentionShape& shape, const HeadItem& item,
                               int64_t i0, int64_t rows) {
  Range all;
  bool any = false;
  for (int64_t i = i0; i < i0 + rows; ++i) {
    const Range r = VisibleKeys(shape, item, i).hull();
    if (r.empty()) continue;
    all.begin = any ? std::min(all.begin, r.begin) : r.begin;
    all.end = any ? std::max(all.end, r.end) : r.end;
    any = true;
  }
  return any ? all : Range{};
}

// Row r's visible keys in tile coordinates (within [0, t.cols)), by the diagonal/window rule and
// the kv head's window.
inline RowKeys RowVisibleCols(const AttentionShape& shape, const HeadItem& item, const Tile& t,
                              int64_t r) {
  const RowKeys keys = VisibleKeys(shape, item, t.i0 + r);
  const auto to_tile = [&](Range k) {
    return Range{std::clamp<int64_t>(k.begin - t.j0, 0, t.cols),
                 std::clamp<int64_t>(k.end - t.j0, 0, t.cols)};
  };
  return RowKeys{to_tile(keys.low), to_tile(keys.high)};
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

// OR of the mask over rows [0, rows) × contiguous columns [0, cols): 32 bytes per load and one
// test per 8 rows, so the (cache-missing) row loads overlap instead of each waiting on a branch.
inline bool MaskBlockAny(const bool* first_row, int64_t row_stride, int64_t rows, int64_t cols) {
  typedef uint8_t Bytes32 __attribute__((vector_size(32)));
  const uint8_t* m = reinterpret_cast<const uint8_t*>(first_row);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    Bytes32 wide{};
    uint8_t narrow = 0;
    for (int64_t r = r0; r < std::min(r0 + 8, rows); ++r) {
      const uint8_t* row = m + r * row_stride;
      int64_t c = 0;
      for (; c + 32 <= cols; c += 32) {
        Bytes32 v;
        std::memcpy(&v, row + c, sizeof(v));
        wide |= v;
      }
      for (; c < cols; ++c) narrow |= row[c];
    }
    uint64_t words[4];
    std::memcpy(words, &wide, sizeof(words));
    if ((words[0] | words[1] | words[2] | words[3] | narrow) != 0) return true;
  }
  return false;
}

// Whether the tile's query rows and keys may share a segment id: their ids' [min, max] spans
// overlap. Packed (sorted) ids make this exact; any order keeps it safe (it never skips a
// visible pair).
inline bool TileSegmentsMeet(const HeadItem& item, const Tile& t) {
  if (item.q_segments == nullptr) return true;
  const auto [q_lo, q_hi] = std::minmax_element(item.q_segments + t.i0,
                                                item.q_segments + t.i0 + t.rows);
  const auto [k_lo, k_hi] = std::minmax_element(item.kv_segments + t.j0,
                                                item.kv_segments + t.j0 + t.cols);
  return *q_lo <= *k_hi && *k_lo <= *q_hi;
}

// Whether some of the n ranges [start[k], end[k]) meets [lo, hi): a tile's key ranges against
// its rows, or its row ranges against its keys. Exact per range, so a tile of empty or disjoint
// ranges is skipped; O(n) next to the tile's O(rows * cols * D) work.
inline bool AnyRangeMeets(const int32_t* start, const int32_t* end, int64_t n, int64_t lo,
                          int64_t hi) {
  for (int64_t k = 0; k < n; ++k) {
    if (std::max<int64_t>(start[k], lo) < std::min<int64_t>(end[k], hi)) return true;
  }
  return false;
}

inline bool TileRangesMeet(const HeadItem& item, const Tile& t) {
  return (item.key_start == nullptr || AnyRangeMeets(item.key_start + t.j0, item.key_end + t.j0,
                                                     t.cols, t.i0, t.i0 + t.rows)) &&
         (item.row_start == nullptr || AnyRangeMeets(item.row_start + t.i0, item.row_end + t.i0,
                                                     t.rows, t.j0, t.j0 + t.cols));
}

// The K key blocks query block n lists (entries naming no block included).
inline const int32_t* ListedKeyBlocks(const AttentionShape& shape, const HeadItem& item,
                                      int64_t n) {
  return item.block_indices + n * shape.block_indices.row_stride;
}

// Whether a key block listed for one of the tile's query blocks meets its keys [j0, j0 + cols):
// key block m holds keys [m * block_k, (m + 1) * block_k), so -1 and any entry outside
// [0, ceil(Lk / block_k)) meet no tile. Exact per query block, O(K) each.
inline bool TileBlocksMeet(const AttentionShape& shape, const HeadItem& item, const Tile& t) {
  if (item.block_indices == nullptr) return true;
  const int64_t bk = shape.block_k, j_end = t.j0 + t.cols;
  const int64_t last = (t.i0 + t.rows - 1) / shape.block_q;
  for (int64_t n = t.i0 / shape.block_q; n <= last; ++n) {
    const int32_t* listed = ListedKeyBlocks(shape, item, n);
    for (int64_t s = 0; s < shape.block_slots; ++s) {
      const int64_t m = listed[s];
      if (std::max(m * bk, t.j0) < std::min((m + 1) * bk, j_end)) return true;
    }
  }
  return false;
}

// [min, max] of n values `stride` apart; both NaN where any value is NaN (std::min / std::max
// alone would skip a NaN anywhere but first).
inline void MinMax(const float* x, int64_t n, int64_t stride, double* lo, double* hi) {
  float a = x[0], b = x[0];
  bool nan = std::isnan(x[0]);
  for (int64_t k = 1; k < n; ++k) {
    const float v = x[k * stride];
    nan |= std::isnan(v);
    a = std::min(a, v);
    b = std::max(b, v);
  }
  *lo = nan ? NAN : a;
  *hi = nan ? NAN : b;
}

// Whether the gate threshold keeps the grid block of the tile (common/params.h: GateBlockKept
// on the min and max of alpha and delta over the block's rows and keys, every row and key below
// Lq and Lk whatever the lengths). Always true without a threshold.
inline bool TileGateKept(const AttentionShape& shape, const HeadItem& item, const Tile& t) {
  if (item.alpha == nullptr || !shape.has_gate_threshold()) return true;
  const int64_t i0 = t.i0 / kGateBlockQ * kGateBlockQ, j0 = t.j0 / kGateBlockK * kGateBlockK;
  double a_lo, a_hi, d_lo, d_hi;
  MinMax(item.alpha + i0 * shape.num_heads, std::min(kGateBlockQ, shape.seqlen_q - i0),
         shape.num_heads, &a_lo, &a_hi);
  MinMax(item.delta + j0 * shape.num_kv_heads, std::min(kGateBlockK, shape.seqlen_k - j0),
         shape.num_kv_heads, &d_lo, &d_hi);
  return GateBlockKept(a_lo, a_hi, d_lo, d_hi, shape.gate_cut);
}

// Whether the forward's softmax threshold dropped the grid block of the tile (backward only).
inline bool TileDropped(const AttentionShape& shape, const HeadItem& item, const Tile& t) {
  return item.drop_map != nullptr &&
         item.drop_map[t.i0 / kSkipBlockQ * shape.skip_cols() + t.j0 / kSkipBlockK] != 0;
}

// The number of keys row i may see by position alone (kv_len, the diagonal/window rule, its kv
// head's window and sink; no mask): n_i of softmax-threshold skipping (common/params.h).
inline int64_t PositionalKeyCount(const AttentionShape& shape, const HeadItem& item, int64_t i) {
  const RowKeys keys = VisibleKeys(shape, item, i);
  return std::max<int64_t>(keys.low.end - keys.low.begin, 0) +
         std::max<int64_t>(keys.high.end - keys.high.begin, 0);
}

// Whether any (row, key) of the tile is visible: the forward's softmax-threshold drops, the
// gate threshold's block, the segment ids' spans, the key and row ranges, the block indices and
// the diagonal/window rule first, then an OR over the mask entries they leave (upstream's
// __syncthreads_or). A false answer means the tile is skipped: no K/V/bias loads, no math.
// item_mask is null when there is no mask.
inline bool TileHasVisibleKey(const AttentionShape& shape, const HeadItem& item,
                              const bool* item_mask, const Tile& t) {
  if (t.rows == 0 || t.cols == 0 || TileDropped(shape, item, t) ||
      !TileGateKept(shape, item, t) || !TileSegmentsMeet(item, t) || !TileRangesMeet(item, t) ||
      !TileBlocksMeet(shape, item, t))
    return false;
  // The rule's visible columns only move right down the rows, so it leaves the whole tile when
  // the last row starts at column 0 and the first row ends at the last column: the common case,
  // scanned block-wise. A head window's sink breaks that monotony: such items go row by row.
  const bool whole_tile = !item.head_window &&
                          RowVisibleCols(shape, item, t, t.rows - 1).low.begin == 0 &&
                          RowVisibleCols(shape, item, t, 0).low.end == t.cols;
  if (whole_tile && item_mask == nullptr) return true;
  if (whole_tile && shape.mask.col_stride == 1) {
    const int64_t rows = shape.mask.broadcast_over_rows() ? 1 : t.rows;
    return MaskBlockAny(OperandRow(item_mask, shape.mask, t, 0), shape.mask.row_stride, rows,
                        t.cols);
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    const RowKeys cols = RowVisibleCols(shape, item, t, r);
    if (cols.empty()) continue;
    if (item_mask == nullptr) return true;
    const bool* row = OperandRow(item_mask, shape.mask, t, r);
    if (MaskRowAny(row, shape.mask.col_stride, cols.low) ||
        MaskRowAny(row, shape.mask.col_stride, cols.high))
      return true;
  }
  return false;
}

}  // namespace dmattn::cpu
