// Persistent tile scheduler of the Hopper forward: one CTA per SM takes tiles (batch, head,
// query block) of one fixed order until none is left.
//
// The order: (batch, head) pairs in groups of `group_heads`, a group's K / V small enough to stay
// in L2 while all its tiles run (otherwise 132 CTAs on 132 different heads would each stream
// their K / V from memory); within a group the query blocks from the last to the first (under
// causality the last has the most keys: the heaviest tiles start first and the light ones fill
// the tail), heads innermost.
//
// Each CTA starts at tile blockIdx.x; its next tile is the next one of a global counter (an
// atomic in the forward's workspace, zeroed by the launcher), so a CTA that finishes early takes
// more tiles: a greedy, longest-first schedule. (Drawing it as the CTA starts a tile, the
// atomic's round trip hidden, cost the causal and block-sparse forwards 3-5 %: a CTA then
// commits to its next tile a whole tile early.) Without the counter, the CTAs stride the order
// by gridDim.x. The producer draws the tiles, works out what each
// covers (tile_work: 64-bit divisions and the sequence lengths' loads, a few hundred
// instructions) and hands both to the consumers through a two-slot queue in shared memory
// (TileQueue).
#pragma once

#include <cstring>
#include <type_traits>

#include "cuda/block_map.cuh"
#include "cuda/gate.cuh"
#include "cuda/kernel_utils.cuh"
#include "cuda/mask_forms.cuh"
#include "cuda/segments.cuh"
#include "cuda/sm90/fwd_params.h"
#include "cuda/sm90/fwd_traits.cuh"
#include "cuda/sm90/sync.cuh"

namespace dmattn::cuda::sm90 {

struct FwdTile {
  int m_block;
  int64_t bh;  // batch * H + head
};

__device__ __forceinline__ FwdTile tile_at(const TileOrder& o, int64_t t) {
  const int64_t group_tiles = o.group_heads * o.m_blocks;
  const int64_t group = t / group_tiles;
  const int64_t i = t - group * group_tiles;
  const int64_t first = group * o.group_heads;
  const int64_t heads = min(o.group_heads, o.heads - first);
  const int64_t block_rank = i / heads;
  return {o.m_blocks - 1 - static_cast<int>(block_rank), first + (i - block_rank * heads)};
}

// The producer's next tile after t.
__device__ __forceinline__ int64_t next_tile(const TileOrder& o, int64_t t) {
  if (o.counter == nullptr) return t + gridDim.x;
  return static_cast<int64_t>(atomicAdd(o.counter, 1)) + gridDim.x;
}

// The position rule of kv head hk (kernel_utils.cuh: position_rule_of) from the call's band as
// the host worked it out (FwdParamsSm90::band).
template <typename Tr>
__device__ __forceinline__ detail::PositionRule head_rule(const FwdParamsSm90& P, int hk) {
  if constexpr (Tr::kTable) return detail::position_rule(P.band, P.p.windows, hk);
  return {P.band, P.band, 0};
}

// What a tile covers: query rows m0 .. m0 + BM - 1 of (batch b, head h), the key blocks
// [keys.lo, keys.hi) that lengths and the position rule leave visible to some of them (with a
// sink, the gap between the sink's blocks and the band's is inside; KeyWalk steps over it), and
// the entries of the bias and mask that (b, h) reads (kOperands kernels; 64-bit divisions that
// each warp would otherwise repeat for every tile or key block).
struct TileWork {
  int64_t b;
  int h, hk;
  int m0;
  detail::SeqLens lens;
  detail::BlockRange keys;
  OperandEntry bias, mask;
  __device__ __forceinline__ bool empty() const { return keys.hi <= keys.lo; }
};

template <typename Tr>
__device__ __forceinline__ TileWork tile_work(const FwdParamsSm90& P, int64_t t) {
  const AttentionShape& s = P.p.s;
  const FwdTile tile = tile_at(P.order, t);
  const int H = static_cast<int>(s.num_heads);
  TileWork w;
  w.b = tile.bh / H;
  w.h = static_cast<int>(tile.bh - w.b * H);
  w.hk = w.h / static_cast<int>(s.num_heads / s.num_kv_heads);
  w.m0 = tile.m_block * Tr::BM;
  w.lens = detail::seq_lens(s, P.p.q_lens, P.p.kv_lens, w.b);
  w.keys = detail::visible_key_blocks<Tr::BM, Tr::BN, Tr::kTable>(
                 w.lens, head_rule<Tr>(P, w.hk), w.m0)
               .all;
  if constexpr (Tr::kOperands) {
    if (Tr::kBias && P.p.bias != nullptr) w.bias = P.bias_tiles.entry(s.bias, s.batch, w.b, w.h);
    if (P.p.mask != nullptr) w.mask = P.mask_tiles.entry(s.mask, s.batch, w.b, w.h);
  }
  return w;
}

// A tile as the producer hands it to the consumers: its index in the order (past the last one:
// no tile is left) and its work, worked out once for all the warps that run it.
struct QueuedTile {
  int64_t t;
  TileWork work;
};
static_assert(sizeof(QueuedTile) <= kQueuedTileBytes && sizeof(QueuedTile) % 4 == 0,
              "a queue slot holds one tile, passed between lanes as 32-bit words");

// Tiles from the producer to the consumers (and the operand warp): sync.cuh's SmemQueue.
template <int kSlots>
using TileQueue = SmemQueue<QueuedTile, kSlots>;

// The gate threshold's verdicts on a gated tile's key blocks: a base of KeyWalk, empty in the
// kernels without the gate.
struct NoGatePass {};
struct GatePass {
  detail::GateFilter<true> filter;
  int lo;  // the tile's first visible block
};

// The tile's key blocks that the mask (with kSegments the segment ids, segments.cuh; with kForms
// the block indices, mask_forms.cuh) leave visible (all of them without any), from the last to
// the first (block_map.cuh; threshold kernels from the first to the last: Tr::kKeyStep),
// stepping over the gap below a window table's band (kTable); warp-wide. first_block(): the first
// of them; after(n): the one after n; holds(n): whether n is one of them (else the walk is over).
// Kernels that take none compile no walk at all (csrc/cuda/README.md: the walk's code in their
// main loop). Gated kernels pass over the blocks of the gate threshold's grid that it drops
// (gate.cuh: GateFilter; every block is kept without a threshold).
template <typename Tr>
struct KeyWalk : std::conditional_t<Tr::kGate, GatePass, NoGatePass> {
  using MaskFlags = detail::KeyTileFlags<Tr::BM, Tr::BN>;
  using Flags = std::conditional_t<
      Tr::kSegments, detail::SegmentedTileFlags<MaskFlags, Tr::BN, true>,
      std::conditional_t<Tr::kForms, detail::FormKeyTileFlags<Tr::BM, Tr::BN>, MaskFlags>>;
  using Gate = std::conditional_t<Tr::kGate, GatePass, NoGatePass>;
  static constexpr int kStep = Tr::kKeyStep;
  static_assert(kStep < 0 || (!Tr::kGate && !Tr::kTable), "the gate's and the gap's walks go down");
  detail::TileWalk<kStep, Flags> walk;
  detail::KeyGap gap;
  detail::BlockRange keys;
  __device__ __forceinline__ KeyWalk(const FwdParamsSm90& P, const TileWork& w)
      : Gate(gate_of(P, w)), walk(make(P, w)), gap(gap_of(P, w)), keys(w.keys) {}
  __device__ __forceinline__ int first_block(const TileWork& w, int* flags) {
    if (w.empty()) return end();
    return next(kStep < 0 ? keys.hi - 1 : keys.lo, flags);
  }
  __device__ __forceinline__ int after(int n, int* flags) { return next(n + kStep, flags); }
  __device__ __forceinline__ bool holds(int n) const {
    return kStep < 0 ? n >= keys.lo : n < keys.hi;
  }
  __device__ __forceinline__ int end() const { return kStep < 0 ? keys.lo - 1 : keys.hi; }
  __device__ __forceinline__ int next(int n, int* flags) {
    n = visible(n, flags);
    if constexpr (Tr::kGate) {
      n = this->filter.template next_kept<Tr::BN>(
          n, this->lo - 1, [&](int m, int* f) { return visible(m, f); }, flags);
    }
    return n;
  }

 private:
  // The next block at or below n that the mask, the segment ids and the position rule leave.
  __device__ __forceinline__ int visible(int n, int* flags) {
    constexpr bool kWalks = Tr::kOperands || Tr::kSegments || Tr::kForms;
    if constexpr (kWalks && Tr::kTable) {
      return gap.next(n, flags, [&](int t, int* f) { return walk.next(t, f); });
    } else if constexpr (kWalks) {
      return walk.next(n, flags);
    } else {
      *flags = detail::kTileAny | detail::kTileAll;
      return Tr::kTable ? gap.at_or_below(n) : n;
    }
  }
  static __device__ __forceinline__ Gate gate_of(const FwdParamsSm90& P, const TileWork& w) {
    if constexpr (Tr::kGate) {
      return {detail::GateFilter<true>(detail::GateView(P.p, w.b, w.h),
                                       w.m0 / static_cast<int>(kGateBlockQ)),
              w.keys.lo};
    } else {
      return {};
    }
  }
  // The gap of a window table's sink in the tile's blocks (kTable kernels; none elsewhere).
  static __device__ __forceinline__ detail::KeyGap gap_of(const FwdParamsSm90& P,
                                                         const TileWork& w) {
    if constexpr (Tr::kTable) {
      return detail::visible_key_blocks<Tr::BM, Tr::BN>(
                 w.lens, head_rule<Tr>(P, w.hk), w.m0)
          .gap;
    } else {
      return {};
    }
  }
  static __device__ __forceinline__ detail::TileWalk<kStep, Flags> make(const FwdParamsSm90& P,
                                                                       const TileWork& w) {
    const FwdParams& p = P.p;
    const bool has_mask = Tr::kOperands && p.mask != nullptr;
    const MaskFlags mask{detail::MaskMapView(p.mask_map, P.mask_tiles.index(w.mask)), w.m0};
    const int end = kStep < 0 ? w.keys.lo - 1 : w.keys.hi;
    if constexpr (Tr::kSegments) {
      const detail::SegmentSpansView spans(p.segment_spans, p.s, w.b);
      return detail::TileWalk<kStep, Flags>(true, {mask, has_mask, spans, spans.rows<Tr::BM>(w.m0)},
                                            end);
    } else if constexpr (Tr::kForms) {
      return detail::TileWalk<kStep, Flags>(
          true, {&p.forms, detail::FormEntries(p.forms, p.s, w.b, w.h).block, w.m0}, end);
    } else {
      return detail::TileWalk<kStep, Flags>(has_mask, mask, end);
    }
  }
};

}  // namespace dmattn::cuda::sm90
