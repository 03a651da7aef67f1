// Segment ids (sequence packing) in the attention kernels: query i sees key j only where
// q_segments[i] == kv_segments[j].
//
// A pass before the attention kernels (segment_spans_kernel) writes the {min, max} of every
// kSegmentCell ids of each id row (SegmentSpanLayout), so that a kernel's tile walk learns
// whether a tile's query and key ids can meet from one 8-byte load per cell, 32 tiles at a time
// (TileWalk), instead of reading every id of the tiles it skips. A tile whose spans do not meet
// is skipped like an all-false mask tile (no loads, no GEMM); a tile whose ids are all one value
// needs no per-score test; the others (kTileIndexed) compare the ids of each score, read from a
// small shared-memory tile (the kernels' kSegmentSmem prefix). The FlashAttention-2-class
// kernels apply them with the other index masks (index_masks.cuh); the Hopper forward, which
// takes no other, by SegmentedTileFlags.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/block_map.cuh"
#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda {

// Shared memory the segment-reading kernels put in front of their own layout (which keeps the
// 1024-byte alignment of its wgmma operands): the ids of one key block and of the query blocks
// in flight.
constexpr int kSegmentSmem = 1024;

namespace detail {

// An inclusive span of ids; empty when lo > hi.
struct IdSpan {
  int lo = INT_MAX;
  int hi = INT_MIN;
};

__device__ __forceinline__ IdSpan join(IdSpan a, IdSpan b) {
  return {min(a.lo, b.lo), max(a.hi, b.hi)};
}

// The spans of the ids of batch entry b (SegmentSpanLayout in kernel_params.h).
struct SegmentSpansView {
  const int2* q;   // [ceil(Lq / cell)] of the entry's id row
  const int2* kv;  // [ceil(Lk / cell)]
  int q_cells, kv_cells;

  __device__ __forceinline__ SegmentSpansView(const SegmentSpanLayout& l, const AttentionShape& s,
                                              int64_t b) {
    const int64_t row = s.segments_batch.offset(s.batch, b);
    q = l.spans + row * l.q_cells;
    kv = l.spans + l.rows * l.q_cells + row * l.kv_cells;
    q_cells = l.q_cells;
    kv_cells = l.kv_cells;
  }

  // The span of the ids of the N positions from p0 (a multiple of N) of a side with `cells`.
  template <int N>
  static __device__ __forceinline__ IdSpan span(const int2* cells_of, int cells, int p0) {
    static_assert(N % kSegmentCell == 0, "tiles cover whole cells");
    IdSpan r;
    const int c0 = p0 / kSegmentCell;
#pragma unroll
    for (int c = 0; c < N / kSegmentCell; ++c) {
      if (c0 + c < cells) {
        const int2 v = __ldg(cells_of + c0 + c);
        r = join(r, {v.x, v.y});
      }
    }
    return r;
  }
  template <int BM>
  __device__ __forceinline__ IdSpan rows(int m0) const { return span<BM>(q, q_cells, m0); }
  template <int BN>
  __device__ __forceinline__ IdSpan keys(int n0) const { return span<BN>(kv, kv_cells, n0); }
};

// What the ids of a tile whose query and key id spans are `a` and `b` hide: every score (0), no
// score (kTileAny) or some (kTileAny | kTileIndexed).
__device__ __forceinline__ int segment_flags(IdSpan a, IdSpan b) {
  if (a.lo > b.hi || b.lo > a.hi) return 0;  // no id in common (or an empty side)
  const bool one_id = a.lo == a.hi && b.lo == b.hi;  // and they meet: the same id
  return one_id ? kTileAny : (kTileAny | kTileIndexed);
}

// The Hopper forward's tile walk flags (FlagsOf of TileWalk, block_map.cuh) with the segment ids
// applied: the mask's flags (all visible without a mask) and-ed with what the ids leave visible.
// The walk moves along one side (kBlock positions a tile); `fixed` is the span of the other
// side's ids.
template <typename MaskFlags, int kBlock, bool kAlongKeys>
struct SegmentedTileFlags {
  MaskFlags mask;
  bool has_mask;
  SegmentSpansView spans;
  IdSpan fixed;

  __device__ __forceinline__ int operator()(int t) const {
    const int f = has_mask ? mask(t) : (kTileAny | kTileAll);
    if (!(f & kTileAny)) return 0;
    const IdSpan walked = kAlongKeys ? spans.keys<kBlock>(t * kBlock)
                                     : spans.rows<kBlock>(t * kBlock);
    const int seg = segment_flags(fixed, walked);
    return seg ? (f | seg) : 0;
  }
};

// The ids of batch entry b: q [Lq], kv [Lk].
template <typename Params>
__device__ __forceinline__ const int32_t* q_segment_row(const Params& p, int64_t b) {
  return p.q_segments + p.s.segments_batch.offset(p.s.batch, b) * p.s.seqlen_q;
}
template <typename Params>
__device__ __forceinline__ const int32_t* kv_segment_row(const Params& p, int64_t b) {
  return p.kv_segments + p.s.segments_batch.offset(p.s.batch, b) * p.s.seqlen_k;
}

// ids[0 .. n) of a row into a shared-memory tile of N ints with 4-byte cp.async, zeros past n
// (positions there are out of bounds, hidden by the bounds test).
template <int N, int NT>
__device__ __forceinline__ void load_ids_async(int32_t* smem, const int32_t* ids, int n,
                                               int tid) {
#pragma unroll
  for (int i = tid; i < N; i += NT) {
    const bool ok = i < n;
    cp_async4(smem_u32(smem + i), ok ? ids + i : ids, ok ? 4 : 0);
  }
}

}  // namespace detail
}  // namespace dmattn::cuda
