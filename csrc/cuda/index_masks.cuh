// Index masks in the FlashAttention-2-class kernels: segment ids (segments.cuh) and the O(L)
// mask forms (mask_forms.cuh). A tile walk applies them after the mask's block map: a tile either
// hides is skipped, and a tile that one leaves partly visible carries kTileIndexed, which makes
// the kernel test each score (the segment ids from shared memory, the forms by MaskFormsView).
#pragma once

#include "cuda/block_map.cuh"
#include "cuda/mask_forms.cuh"
#include "cuda/segments.cuh"

namespace dmattn::cuda {

// The index masks a kernel compiles (its kIndex template argument): none, segment ids alone,
// the forms beside optional segment ids, or those and the gate (gate.cuh). The segment-id
// kernels compile none of the forms' code (with it, the packed backward ran 1.57 -> 1.64 ms on an
// H100: registers), the forms' none of the gate's (with it, their sm_90a D128 backward spilled
// 452 -> 648 bytes).
enum IndexKind : int { kNoIndex = 0, kSegmentIds = 1, kFormsAndIds = 2, kGatedForms = 3 };

// Shared memory ahead of a kIndex kernel's tiles: the segment ids' (kSegmentSmem), and for the
// gate as much again (gate.cuh: a key block's delta, each query stage's alpha, laid out as the
// ids).
constexpr int IndexPrefixSmem(int index) {
  return index == kNoIndex ? 0 : index == kGatedForms ? 2 * kSegmentSmem : kSegmentSmem;
}
constexpr int kMaxIndexPrefixSmem = IndexPrefixSmem(kGatedForms);

// The kind of a call's index masks.
template <typename Params>
inline int IndexKindOf(const Params& p) {
  if (p.alpha != nullptr) return kGatedForms;
  return p.forms.present ? kFormsAndIds : (p.q_segments != nullptr ? kSegmentIds : kNoIndex);
}

namespace detail {

// What a kIndex kernel's call has: segment ids, forms (compile-time false where not compiled).
template <int kIndex, typename Params>
__device__ __forceinline__ bool has_segment_ids(const Params& p) {
  return kIndex == kSegmentIds || (kIndex >= kFormsAndIds && p.q_segments != nullptr);
}
template <int kIndex, typename Params>
__device__ __forceinline__ bool has_mask_forms(const Params& p) {
  return kIndex >= kFormsAndIds && p.forms.present;
}

// The index masks of one (batch entry b, query head h), whose forms' entries are `entries`
// (worked out once by the kernel). The forms stay in the kernel's parameters (`forms` points
// there) and their view is built where it is read: a walk kept across key blocks would hold it
// in registers.
template <int kIndex>
struct IndexMasks {
  bool has_segments;
  bool has_forms;
  SegmentSpansView spans;
  const MaskForms* forms;
  FormEntries entries;

  template <typename Params>
  __device__ __forceinline__ IndexMasks(const Params& p, int64_t b, FormEntries entries)
      : has_segments(has_segment_ids<kIndex>(p)),
        has_forms(has_mask_forms<kIndex>(p)),
        spans(p.segment_spans, p.s, b),
        forms(&p.forms),
        entries(entries) {}

  __device__ __forceinline__ MaskFormsView form_view() const {
    return MaskFormsView(*forms, entries);
  }
};

// A tile walk's flags (FlagsOf of TileWalk, block_map.cuh) with the index masks applied: the
// mask's flags (all visible without a mask) and-ed with what the ids and forms leave visible.
// The walk moves along one side; the other's ids span `ids`.
template <typename MaskFlags, int BM, int BN, bool kAlongKeys, int kIndex>
struct IndexedTileFlags {
  MaskFlags mask;  // its m0 (walking keys) or n0 (walking queries): the fixed side's tile
  bool has_mask;
  IndexMasks<kIndex> masks;
  IdSpan ids;

  __device__ __forceinline__ int operator()(int t) const {
    int f = has_mask ? mask(t) : (kTileAny | kTileAll);
    if (!(f & kTileAny)) return 0;
    int r0, c0;
    if constexpr (kAlongKeys) {
      r0 = mask.m0;
      c0 = t * BN;
    } else {
      r0 = t * BM;
      c0 = mask.n0;
    }
    if (masks.has_segments) {
      const IdSpan walked = kAlongKeys ? masks.spans.keys<BN>(c0) : masks.spans.rows<BM>(r0);
      const int seg = segment_flags(ids, walked);
      if (!seg) return 0;
      f |= seg;
    }
    if (masks.has_forms) {
      const int form = masks.form_view().template tile<BM, BN>(r0, c0);
      if (!form) return 0;
      f |= form;
    }
    return f;
  }
};

// Key blocks n, n - 1, ... down to n_lo of query rows m0.. that the mask and the index masks
// leave visible (forward, dq kernel); n_lo - 1 when none is left.
template <int BM, int BN, int kIndex>
using IndexedKeyWalk =
    TileWalk<-1, IndexedTileFlags<KeyTileFlags<BM, BN>, BM, BN, true, kIndex>>;
template <int BM, int BN, int kIndex>
__device__ __forceinline__ IndexedKeyWalk<BM, BN, kIndex> indexed_key_block_walk(
    const MaskMapView& map, bool has_mask, int m0, int n_lo, const IndexMasks<kIndex>& masks) {
  const IdSpan rows = masks.has_segments ? masks.spans.template rows<BM>(m0) : IdSpan{};
  return IndexedKeyWalk<BM, BN, kIndex>(true, {{map, m0}, has_mask, masks, rows}, n_lo - 1);
}

// Key blocks n, n + 1, ... up to n_hi - 1 of query rows m0.. that the mask and the index masks
// leave visible (the softmax-threshold forward, which visits them as its rule does); n_hi when
// none is left.
template <int BM, int BN, int kIndex>
using IndexedKeyWalkUp = TileWalk<1, IndexedTileFlags<KeyTileFlags<BM, BN>, BM, BN, true, kIndex>>;
template <int BM, int BN, int kIndex>
__device__ __forceinline__ IndexedKeyWalkUp<BM, BN, kIndex> indexed_key_block_walk_up(
    const MaskMapView& map, bool has_mask, int m0, int n_hi, const IndexMasks<kIndex>& masks) {
  const IdSpan rows = masks.has_segments ? masks.spans.template rows<BM>(m0) : IdSpan{};
  return IndexedKeyWalkUp<BM, BN, kIndex>(true, {{map, m0}, has_mask, masks, rows}, n_hi);
}

// Query blocks m, m + 1, ... up to m_last of key columns n0.. that the mask and the index masks
// leave visible (backward); m_last + 1 when none is left.
template <int BM, int BN, int kIndex>
using IndexedQueryWalk =
    TileWalk<1, IndexedTileFlags<QueryTileFlags<BM, BN>, BM, BN, false, kIndex>>;
template <int BM, int BN, int kIndex>
__device__ __forceinline__ IndexedQueryWalk<BM, BN, kIndex> indexed_query_block_walk(
    const MaskMapView& map, bool has_mask, int n0, int m_last, const IndexMasks<kIndex>& masks) {
  const IdSpan keys = masks.has_segments ? masks.spans.template keys<BN>(n0) : IdSpan{};
  return IndexedQueryWalk<BM, BN, kIndex>(true, {{map, n0}, has_mask, masks, keys}, m_last + 1);
}

}  // namespace detail
}  // namespace dmattn::cuda
