// The work of one CTA of the Hopper backward: its key block, kv head and dk / dv class (the
// FlashAttention-2-class backward's grid, bwd_cta), and the sequence of query blocks it runs: for
// every (batch, query head) pair that reads its kv slot (the class's batches x the kv head's query
// heads), the query blocks whose rows see some key of the block by lengths and position and whose
// tile neither the mask (its block map) nor the segment ids (their spans, segments.cuh) hide
// entirely, read 32 tiles at a time by TileWalk. A scheduler warp walks them and queues each block
// with what the other roles need of it (QueuedBlock: the consumers' rows, lengths and mask, the
// loader's and the dQ warps' coordinates), so that neither the consumers' nor the loader's
// registers carry the walk. With a mask, the CTAs take the key blocks heaviest first (the block
// order of launch_template.cuh); deterministic calls fix the order in which the key blocks add to a
// query block's dQ: from the last key block down.
#pragma once

#include <type_traits>

#include "cuda/block_map.cuh"
#include "cuda/bwd_kernel.cuh"
#include "cuda/drop_map.cuh"
#include "cuda/gate.cuh"
#include "cuda/mask_forms.cuh"
#include "cuda/segments.cuh"
#include "cuda/sm90/bwd_traits.cuh"

namespace dmattn::cuda::sm90 {

struct BwdCtaWork {
  detail::BwdCta cta;
  int n0;        // first key of the block
  int G;         // query heads per kv head
  int64_t pairs;  // (batch, query head) pairs
  detail::Band band;
};

// One query block of the walk.
struct BwdBlock {
  int64_t b;
  int h;
  int m0;
  detail::SeqLens lens;
  uint32_t lse_base;  // the pair's first lse / D row (modulo 2^32: TMA coordinates are 32-bit)
  int tile_flags;     // of its tile (QueryFlags): kTileAll, its mask bits need no load;
                      // kTileIndexed, its ids need comparing
};

// The CTAs of a deterministic call. The key blocks of a (kv head, class) slot add to a query
// block's dQ from the last one down, and a CTA may wait only for CTAs launched before it, so the
// CTAs take the key blocks in that order. Those of P.chain_slots slots (about as many as run at
// once) interleave key block by key block: the CTAs that finish together (the same key block of
// the running slots) are replaced by the same key block of the next slots, so that each CTA
// starts about a turn after its predecessor and seldom waits. (Slot by slot, the CTAs of a slot
// started together and queued for every query block's first turn again in each wave.)
__device__ __forceinline__ detail::BwdCta deterministic_cta(const BwdParamsSm90& P, int64_t bid) {
  const BwdParams& p = P.p;
  const int Hk = static_cast<int>(p.s.num_kv_heads);
  const int64_t slots = Hk * p.kv_classes, group_ctas = P.chain_slots * int64_t{p.n_blocks};
  const int64_t group = bid / group_ctas, within = bid % group_ctas;
  const int64_t in_group = min(int64_t{P.chain_slots}, slots - group * P.chain_slots);
  const int64_t slot = group * P.chain_slots + within % in_group;
  return {p.n_blocks - 1 - static_cast<int>(within / in_group), static_cast<int>(slot % Hk),
          slot / Hk};
}

template <typename Tr>
__device__ __forceinline__ BwdCtaWork bwd_cta_work(const BwdParamsSm90& P) {
  const BwdParams& p = P.p;
  BwdCtaWork w;
  w.cta = p.dq_turns != nullptr ? deterministic_cta(P, blockIdx.x)
                                : detail::bwd_cta<false>(p, blockIdx.x);
  w.n0 = w.cta.n_block * Tr::BN;
  w.G = static_cast<int>(p.s.num_heads / p.s.num_kv_heads);
  w.pairs = p.kv_members * w.G;
  w.band = detail::make_band(p.s);
  return w;
}

// Query blocks [*m_first, *m_last] (empty: last < first) whose rows (lengths L) see some key of
// the key block at n0.
template <typename Tr>
__device__ __forceinline__ void query_blocks_of(const BwdCtaWork& w, int n0,
                                                const detail::SeqLens& L, int* m_first,
                                                int* m_last) {
  const detail::PositionRule rule{w.band, w.band, 0};
  detail::query_blocks_seeing<Tr::BM, Tr::BN, false>(n0, L, rule, m_first, m_last);
}

// The flags of the tiles of the key block at n0 with query block t (TileWalk's FlagsOf) of one
// (batch, query head) that has a mask or (kSegments kernels) segment ids: the mask's (all
// visible without one), and-ed with what the ids leave visible; in kForms kernels what the
// block indices leave.
template <typename Tr>
struct QueryFlags {
  using MaskFlags = detail::QueryTileFlags<Tr::BM, Tr::BN>;
  using Tiles = std::conditional_t<
      Tr::kSegments, detail::SegmentedTileFlags<MaskFlags, Tr::BM, false>,
      std::conditional_t<Tr::kForms, detail::FormQueryTileFlags<Tr::BM, Tr::BN>, MaskFlags>>;
  Tiles tiles;
  __device__ __forceinline__ QueryFlags(const BwdParams& p, int64_t b, int h, int n0)
      : tiles(make(p, b, h, n0)) {}
  __device__ __forceinline__ int operator()(int t) const { return tiles(t); }
  // Whether the call's tiles may be hidden at all (else every one is visible, all true).
  static __device__ __forceinline__ bool may_hide(const BwdParams& p) {
    return Tr::kSegments || Tr::kForms || p.mask != nullptr;
  }

 private:
  static __device__ __forceinline__ Tiles make(const BwdParams& p, int64_t b, int h, int n0) {
    const MaskFlags mask{detail::MaskMapView(p.mask_map, p.s, b, h), n0};
    if constexpr (Tr::kSegments) {
      const detail::SegmentSpansView spans(p.segment_spans, p.s, b);
      return {mask, p.mask != nullptr, spans, spans.keys<Tr::BN>(n0)};
    } else if constexpr (Tr::kForms) {
      return {&p.forms, detail::FormEntries(p.forms, p.s, b, h).block, n0};
    } else {
      return mask;
    }
  }
};

// The flags of the tile of query block m0 and the key block at n0 of (batch b, query head h).
template <typename Tr>
__device__ __forceinline__ int tile_flags(const BwdParams& p, int64_t b, int h, int m0, int n0) {
  if (!QueryFlags<Tr>::may_hide(p)) return detail::kTileAny | detail::kTileAll;
  if constexpr (Tr::kSegments || Tr::kForms) return QueryFlags<Tr>(p, b, h, n0)(m0 / Tr::BM);
  return detail::MaskMapView(p.mask_map, p.s, b, h).tile<Tr::BM, Tr::BN>(m0, n0);
}

// The gate threshold's verdicts on the grid blocks of the block's rows against the CTA's keys
// (gated kernels; every block kept without a threshold), or nothing.
template <typename Tr>
__device__ __forceinline__ auto gate_filter(const BwdParams& p, const BwdCtaWork& w,
                                            const BwdBlock& blk) {
  if constexpr (Tr::kGate) {
    return detail::GateFilter<false>(detail::GateView(p, blk.b, blk.h),
                                     w.n0 / static_cast<int>(kGateBlockK));
  } else {
    return 0;
  }
}

// f(block) for every query block of the CTA, in order, but those the mask hides entirely and
// those the gate threshold or the softmax threshold drops (the scheduler's walk, a warp-wide
// call).
template <typename Tr, typename F>
__device__ __forceinline__ void for_each_query_block(const BwdParams& p, const BwdCtaWork& w,
                                                     F&& f) {
#pragma unroll 1
  for (int64_t pi = 0; pi < w.pairs; ++pi) {
    BwdBlock blk;
    blk.b = detail::batch_of(p, w.cta.cls, pi / w.G);
    blk.h = w.cta.hk * w.G + static_cast<int>(pi % w.G);
    blk.lens = detail::seq_lens(p.s, p.q_lens, p.kv_lens, blk.b);
    blk.lse_base = static_cast<uint32_t>(p.s.lse_offset(blk.b, blk.h));
    int m_first, m_last;
    query_blocks_of<Tr>(w, w.n0, blk.lens, &m_first, &m_last);
    detail::TileWalk<1, QueryFlags<Tr>> walk(QueryFlags<Tr>::may_hide(p),
                                             QueryFlags<Tr>(p, blk.b, blk.h, w.n0), m_last + 1);
    const detail::DropFilter<false> drops(p.drop_map, p.s, blk.b, blk.h,
                                          w.n0 / static_cast<int>(kSkipBlockK));
    auto next_block = [&, gate = gate_filter<Tr>(p, w, blk)](int m) mutable {
      auto visible = [&](int i, int* flags) { return walk.next(i, flags); };
      int next = visible(m, &blk.tile_flags);
      if constexpr (Tr::kGate) {
        next = gate.template next_kept<Tr::BM>(next, m_last + 1, visible, &blk.tile_flags);
      }
      return drops.next_kept<Tr::BM>(next, m_last + 1, visible, &blk.tile_flags);
    };
#pragma unroll 1
    for (int m = next_block(m_first); m <= m_last; m = next_block(m + 1)) {
      blk.m0 = m * Tr::BM;
      f(blk);
    }
  }
}

// Deterministic dQ: whether the next key block adds to the block's dQ too (then it goes first:
// the block's turn flag holds its index + 1 once it has).
template <typename Tr>
__device__ __forceinline__ bool next_key_block_sees(const BwdParams& p, const BwdCtaWork& w,
                                                    const BwdBlock& blk) {
  int m_first, m_last;
  const int n0 = w.n0 + Tr::BN;
  query_blocks_of<Tr>(w, n0, blk.lens, &m_first, &m_last);
  const int m = blk.m0 / Tr::BM;
  const detail::DropFilter<false> drops(p.drop_map, p.s, blk.b, blk.h,
                                        n0 / static_cast<int>(kSkipBlockK));
  return m_first <= m && m <= m_last &&
         (tile_flags<Tr>(p, blk.b, blk.h, blk.m0, n0) & detail::kTileAny) &&
         drops.keeps<Tr::BM>(m);
}

// The block as the other roles need it: the consumers' rows, lengths, lse / D shift and mask,
// the loader's and the dQ warps' coordinates and turn flag.
template <typename Tr>
__device__ __forceinline__ QueuedBlock queued_block(const BwdParams& p, const BwdCtaWork& w,
                                                    const BwdBlock& blk) {
  QueuedBlock q{};
  q.m0 = blk.m0;
  q.lens = blk.lens;
  const uint32_t first_row = blk.lse_base + static_cast<uint32_t>(blk.m0);
  q.row_shift = static_cast<uint16_t>(first_row & 3);
  q.lse_box = static_cast<int>(first_row & ~3u);
  if (Tr::kMasks && p.mask != nullptr && !(blk.tile_flags & detail::kTileAll)) {
    q.flags |= kBlockMasked;
  }
  if (Tr::kSegments && (blk.tile_flags & detail::kTileIndexed)) {
    q.flags |= kBlockMasked | kBlockIndexed;
  }
  if (p.dq_turns != nullptr && next_key_block_sees<Tr>(p, w, blk)) q.flags |= kBlockWaits;
  q.b = static_cast<int>(blk.b);
  q.h = blk.h;
  return q;
}

// A deterministic call's dQ turn flag of the block (BwdParams::dq_turns).
template <typename Tr>
__device__ __forceinline__ int32_t* turn_flag(const BwdParams& p, const QueuedBlock& blk) {
  const int64_t row_blocks = (p.s.seqlen_q + Tr::BM - 1) / Tr::BM;
  return p.dq_turns + (int64_t{blk.b} * p.s.num_heads + blk.h) * row_blocks + blk.m0 / Tr::BM;
}

template <typename Tr>
using BlockQueue = SmemQueue<QueuedBlock, Tr::kQueueSlots>;

template <typename Tr>
__device__ __forceinline__ BlockQueue<Tr> block_queue(uint8_t* smem, const BwdBarriers<Tr>& bar) {
  return {reinterpret_cast<QueuedBlock*>(smem + Tr::kOffQueue), bar.queue_full(),
          bar.queue_empty()};
}

// The scheduler warp: every block of the walk into the queue, then the end of the walk.
template <typename Tr>
__device__ __forceinline__ void schedule(const BwdParams& p, const BwdCtaWork& w,
                                         const BlockQueue<Tr>& queue) {
  const bool leader = (threadIdx.x & 31) == 0;
  RingPos<Tr::kQueueSlots> pos;
  for_each_query_block<Tr>(p, w, [&](const BwdBlock& blk) {
    const QueuedBlock q = queued_block<Tr>(p, w, blk);
    if (leader) queue.push(pos, q);
  });
  if (leader) {
    QueuedBlock end{};
    end.m0 = -1;
    queue.push(pos, end);
  }
}

// A role's reading of the queue: each block's part `Part` of QueuedBlock in turn (every thread of
// the role's warps reads); a part with m0 < 0 ends the walk.
template <typename Tr, typename Part>
struct QueueReader {
  BlockQueue<Tr> queue;
  RingPos<Tr::kQueueSlots> pos;
  __device__ __forceinline__ Part next() { return queue.template pop_each<Part>(pos); }
};

// f(block) for every block the scheduler queues, in order (every thread of a warp).
template <typename Tr, typename Part, typename F>
__device__ __forceinline__ void for_each_queued_block(const BlockQueue<Tr>& queue, F&& f) {
  QueueReader<Tr, Part> blocks{queue};
#pragma unroll 1
  for (Part blk = blocks.next(); blk.m0 >= 0; blk = blocks.next()) f(blk);
}

}  // namespace dmattn::cuda::sm90
