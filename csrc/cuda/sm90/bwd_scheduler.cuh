// The work of one CTA of the Hopper backward: its key block, kv head and dk / dv class (the
// FlashAttention-2-class backward's grid, bwd_cta), and the sequence of query blocks it runs:
// for every (batch, query head) pair that reads its kv slot (the class's batches x the kv head's
// query heads), the query blocks whose rows see some key of the block by lengths and position.
// The producer, the dQ warps and the consumers each walk the same sequence. Deterministic calls
// fix the order in which the key blocks add to a query block's dQ: from the last key block down.
#pragma once

#include "cuda/bwd_kernel.cuh"
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

// f(block) for every query block of the CTA, in order.
template <typename Tr, typename F>
__device__ __forceinline__ void for_each_query_block(const BwdParams& p, const BwdCtaWork& w,
                                                     F&& f) {
#pragma unroll 1
  for (int64_t pi = 0; pi < w.pairs; ++pi) {
    BwdBlock blk;
    blk.b = detail::batch_of(p, w.cta.cls, pi / w.G);
    blk.h = w.cta.hk * w.G + static_cast<int>(pi % w.G);
    blk.lens = detail::seq_lens(p.s, p.q_lens, p.kv_lens, blk.b);
    int m_first, m_last;
    query_blocks_of<Tr>(w, w.n0, blk.lens, &m_first, &m_last);
#pragma unroll 1
    for (int m = m_first; m <= m_last; ++m) {
      blk.m0 = m * Tr::BM;
      f(blk);
    }
  }
}

// Deterministic dQ: the block's turn flag (BwdParams::dq_turns), and whether the next key block
// adds to the block's dQ too (then it goes first: the flag holds its index + 1 once it has).
template <typename Tr>
__device__ __forceinline__ int32_t* dq_turn_flag(const BwdParams& p, const BwdBlock& blk) {
  const int64_t row_blocks = (p.s.seqlen_q + Tr::BM - 1) / Tr::BM;
  return p.dq_turns + (blk.b * p.s.num_heads + blk.h) * row_blocks + blk.m0 / Tr::BM;
}
template <typename Tr>
__device__ __forceinline__ bool next_key_block_sees(const BwdCtaWork& w, const BwdBlock& blk) {
  int m_first, m_last;
  query_blocks_of<Tr>(w, w.n0 + Tr::BN, blk.lens, &m_first, &m_last);
  const int m = blk.m0 / Tr::BM;
  return m_first <= m && m <= m_last;
}

}  // namespace dmattn::cuda::sm90
