// The O(L) mask forms in the FlashAttention-2-class kernels (kernel_params.h: MaskForms): key
// ranges (key j seen by the rows start[j] <= i < end[j]), row ranges (row i sees the keys
// start[i] <= j < end[i]) and block indices (row i sees key j when query block i / block_q
// lists key block j / block_k).
//
// A tile walk learns what the forms leave of a tile from their summaries (tile): the hull of
// the ranges of its key (row) cells, or the bits of its blocks, never the forms' elements. A
// tile they hide is skipped like an all-false mask tile; a tile they leave whole needs no
// element test; the others (kTileIndexed, index_masks.cuh) test each score (sees), reading the
// forms straight from memory (cached: a tile reads a few hundred bytes of them).
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda::detail {

// What the ranges of a cell (or of several, joined) allow: rows (keys) [lo, hi) meet some
// non-empty range (an empty hull: lo = INT_MAX, hi = INT_MIN), and every range covers
// [all_lo, all_hi).
struct RangeHull {
  int lo = INT_MAX, hi = INT_MIN;
  int all_lo = INT_MIN, all_hi = INT_MAX;

  __device__ __forceinline__ void join(int4 cell) {
    lo = min(lo, cell.x);
    hi = max(hi, cell.y);
    all_lo = max(all_lo, cell.z);
    all_hi = min(all_hi, cell.w);
  }
  __device__ __forceinline__ bool meets(int a, int b) const { return lo < b && hi > a; }
  __device__ __forceinline__ bool covers(int a, int b) const { return all_lo <= a && all_hi >= b; }
};

// Which entry of each form a (batch entry b, query head h) reads (0 for a form the call lacks):
// worked out once, so that a view costs a few multiplications.
struct FormEntries {
  int key = 0, row = 0, block = 0;

  __device__ __forceinline__ FormEntries(const MaskForms& f, const AttentionShape& s, int64_t b,
                                         int64_t h) {
    if (f.key_start != nullptr) key = static_cast<int>(s.key_ranges.offset(s.batch, b, h) / f.lk);
    if (f.row_start != nullptr) row = static_cast<int>(s.row_ranges.offset(s.batch, b, h) / f.lq);
    if (f.block_bits != nullptr) {
      block = static_cast<int>(s.block_indices.offset(s.batch, b, h) /
                               (static_cast<int64_t>(f.block_rows) * s.block_slots));
    }
  }
};

// The block indices of one (batch, query head) entry as bits: query block qb lists key block kb
// when bit kb of row qb is set (null bits: the call has none).
struct BlockBits {
  const uint32_t* bits = nullptr;
  int words = 0;
  FastDiv div_q, div_k;

  BlockBits() = default;
  __device__ __forceinline__ BlockBits(const MaskForms& f, int entry)
      : bits(f.block_bits + static_cast<int64_t>(entry) * f.block_rows * f.block_words),
        words(f.block_words),
        div_q(f.div_q),
        div_k(f.div_k) {}

  // Whether row i's query block lists key j's block (both inside the sequences).
  __device__ __forceinline__ bool sees(int i, int j) const {
    const int kb = div_k(j);
    return __ldg(bits + div_q(i) * words + kb / 32) >> (kb % 32) & 1u;
  }

  // The listed blocks of rows [r0, r1) and keys [c0, c1): false when no query block there
  // lists a key block there; *whole stays true only when each lists all of them.
  __device__ __forceinline__ bool allow(int r0, int r1, int c0, int c1, bool* whole) const {
    const int kb0 = div_k(c0), kb1 = div_k(c1 - 1);
    bool any = false, every = true;
    for (int qb = div_q(r0); qb <= div_q(r1 - 1); ++qb) {
      for (int w = kb0 / 32; w <= kb1 / 32; ++w) {
        const int lo = max(kb0 - 32 * w, 0), hi = min(kb1 - 32 * w, 31);
        const uint32_t want = (0xffffffffu >> (31 - hi)) & (0xffffffffu << lo);
        const uint32_t got = __ldg(bits + qb * words + w) & want;
        any = any || got != 0;
        every = every && got == want;
      }
    }
    *whole = *whole && every;
    return any;
  }
};

// The forms, as MaskFormsView::sees names them.
constexpr int kKeyRanges = 0, kRowRanges = 1, kBlocks = 2;

// The forms of one (batch, query head): each present form's entry, null where absent.
struct MaskFormsView {
  const int32_t *key_start = nullptr, *key_end = nullptr;
  const int4* key_cells = nullptr;
  const int32_t *row_start = nullptr, *row_end = nullptr;
  const int4* row_cells = nullptr;
  BlockBits blocks;
  int lq, lk;

  __device__ __forceinline__ MaskFormsView(const MaskForms& f, FormEntries e)
      : lq(f.lq), lk(f.lk) {
    if (f.key_start != nullptr) {
      key_start = f.key_start + static_cast<int64_t>(e.key) * lk;
      key_end = f.key_end + static_cast<int64_t>(e.key) * lk;
      key_cells = f.key_cells + static_cast<int64_t>(e.key) * cells(lk);
    }
    if (f.row_start != nullptr) {
      row_start = f.row_start + static_cast<int64_t>(e.row) * lq;
      row_end = f.row_end + static_cast<int64_t>(e.row) * lq;
      row_cells = f.row_cells + static_cast<int64_t>(e.row) * cells(lq);
    }
    if (f.block_bits != nullptr) blocks = BlockBits(f, e.block);
  }
  static __device__ __forceinline__ int cells(int n) { return (n + kRangeCell - 1) / kRangeCell; }

  // What the forms leave of the BM x BN tile at (r0, c0), both inside the sequences: nothing
  // (0), every score (kTileAny) or some (kTileAny | kTileIndexed).
  template <int BM, int BN>
  __device__ __forceinline__ int tile(int r0, int c0) const {
    static_assert(BM % kRangeCell == 0 && BN % kRangeCell == 0, "tiles cover whole cells");
    const int r1 = min(r0 + BM, lq), c1 = min(c0 + BN, lk);
    bool whole = true;
    if (key_cells != nullptr && !hull_allows<BN>(key_cells, c0, lk, r0, r1, &whole)) return 0;
    if (row_cells != nullptr && !hull_allows<BM>(row_cells, r0, lq, c0, c1, &whole)) return 0;
    if (blocks.bits != nullptr && !blocks.allow(r0, r1, c0, c1, &whole)) return 0;
    return whole ? kTileAny : (kTileAny | kTileIndexed);
  }

  // Calls test(sees) for each form the call has, sees(i, j) its element test: a kernel tests a
  // tile form by form, each in a loop of its own, so that fewer of their loads are in flight at
  // once (one loop over all three spilled in the D = 128 forward).
  template <typename Test>
  __device__ __forceinline__ void each_form(Test test) const {
    if (key_start != nullptr) test([&](int i, int j) { return sees<kKeyRanges>(i, j); });
    if (row_start != nullptr) test([&](int i, int j) { return sees<kRowRanges>(i, j); });
    if (blocks.bits != nullptr) test([&](int i, int j) { return sees<kBlocks>(i, j); });
  }
  // Score (i, j) visible by form kForm; positions past the ends read the last row or key (the
  // bounds test hides them).
  template <int kForm>
  __device__ __forceinline__ bool sees(int i, int j) const {
    i = min(i, lq - 1);
    j = min(j, lk - 1);
    if constexpr (kForm == kKeyRanges) {
      return __ldg(key_start + j) <= i && i < __ldg(key_end + j);
    } else if constexpr (kForm == kRowRanges) {
      return __ldg(row_start + i) <= j && j < __ldg(row_end + i);
    } else {
      return blocks.sees(i, j);
    }
  }

 private:
  // The ranges of the N positions from p0 (the walked side's cells, of a side of length n)
  // against positions [a, b) of the other side: false when none meets them; *whole stays true
  // only when every range covers them.
  template <int N>
  static __device__ __forceinline__ bool hull_allows(const int4* cells_of, int p0, int n, int a,
                                                     int b, bool* whole) {
    RangeHull hull;
    const int c0 = p0 / kRangeCell;
#pragma unroll
    for (int c = 0; c < N / kRangeCell; ++c) {
      if ((c0 + c) * kRangeCell < n) hull.join(__ldg(cells_of + c0 + c));
    }
    *whole = *whole && hull.covers(a, b);
    return hull.meets(a, b);
  }
};

// Walks' flags (TileWalk, block_map.cuh) in the Hopper kernels' kForms, whose calls have block
// indices alone (BlockIndicesHoldTiles) and whose tiles they hide or leave whole: a whole tile
// reads as all visible, as a mask's does: one bit tells a tile (or a warpgroup's rows of it), as
// its rows lie in one query block and its keys in one key block. (A MaskFormsView of every form
// cost the forward's producer 52 spill stores, none with the bits alone.)
//
// The forward's tiles of query rows m0.. (key block t) also say which of their 64-row groups (one
// a consumer warpgroup) see them: bit kTileRows << g for rows m0 + 64 g .., so that a warpgroup
// passes the blocks of a tile that only the other's rows see (block indices of 64-row blocks).
constexpr int kTileRows = 8;
template <int BM, int BN>
struct FormKeyTileFlags {
  static_assert(BM % 64 == 0, "64-row groups");
  const MaskForms* forms;
  int entry;  // FormEntries::block
  int m0;
  __device__ __forceinline__ int operator()(int t) const {
    const BlockBits blocks(*forms, entry);
    int rows = 0;
#pragma unroll
    for (int g = 0; g < BM / 64; ++g) {
      const int r0 = m0 + 64 * g;
      if (r0 < forms->lq && blocks.sees(r0, t * BN)) rows |= kTileRows << g;
    }
    return rows ? (rows | kTileAny | kTileAll) : 0;
  }
};
// The backward's tiles of key columns n0.. (query block t).
template <int BM, int BN>
struct FormQueryTileFlags {
  const MaskForms* forms;
  int entry;  // FormEntries::block
  int n0;
  __device__ __forceinline__ int operator()(int t) const {
    return BlockBits(*forms, entry).sees(t * BM, n0) ? (kTileAny | kTileAll) : 0;
  }
};

}  // namespace dmattn::cuda::detail
