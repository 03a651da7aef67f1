// Consumer main loop of the Hopper forward: one warpgroup, 64 query rows of the tile, walks the
// tile's visible key blocks from the last to the first (threshold kernels: the first to the last).
//
//   S(n) = Q K(n)^T          wgmma, both operands in shared memory
//   O   += P(n+1) V(n+1)     wgmma, P from registers: issued right after S(n), so the softmax
//                            of S(n) runs while the tensor cores work on P V
//   S(n): + bias, softcap, -inf where the mask / segment ids / lengths / the diagonal window
//         hide a key, online softmax -> P(n)
//   O   *= the rescale factor of S(n)'s new row maxima, once P V is done (with a mask or bias
//         skipped by a warp none of whose rows' maxima grew)
//   threshold kernels: S(n) dropped before its softmax where the rule says so (fwd_threshold.cuh);
//         the next S GEMM then goes alone, with no P V beside it
//   block-index kernels: a block only the other warpgroup's rows see is passed (its turn taken,
//         its slots released, no S GEMM); a pending P V goes in the pass's turn, and the next
//         S GEMM of this warpgroup's own then goes alone
//
// The consumer warpgroups take turns at issuing their two GEMMs (named barriers kTurnBarrier):
// one warpgroup's softmax runs under the other's GEMMs. Ring slots are released to the producer
// as soon as the wgmma reading them has completed. Each warp walks the mask block map as the
// producer does (block_map.cuh), so all agree on the blocks without a word between them.
#pragma once

#include <type_traits>

#include "cuda/sm90/fwd_threshold.cuh"

namespace dmattn::cuda::sm90 {

template <int kConsumers>
__device__ __forceinline__ void take_turn(int wg) {
  if constexpr (kConsumers > 1) named_sync(kTurnBarrier + wg, 256);
}
template <int kConsumers>
__device__ __forceinline__ void pass_turn(int wg) {
  if constexpr (kConsumers > 1) named_arrive(kTurnBarrier + (wg + 1) % kConsumers, 256);
}

// S = Q K^T (issued, one wgmma group): Q's 64 rows at sq, K's BN rows at sk.
template <typename Tr, typename T>
__device__ __forceinline__ void issue_scores(float (&s)[Tr::BN / 2], uint32_t sq, uint32_t sk) {
  const uint64_t dq = detail::gmma_desc(sq, 0);
  const uint64_t dk = detail::gmma_desc(sk, 0);
  detail::wgmma_async(
      [&] {
        detail::wgmma_issue<0, 0, Tr::D / 16, true>(
            s, dq, dk, [](int ks) { return detail::kmajor_step(ks, Tr::BM); },
            [](int ks) { return detail::kmajor_step(ks, Tr::BN); }, T());
      },
      s);
}

// O += P V (issued, one wgmma group): P from registers, V (MN-major) at sv.
template <typename Tr, typename T>
__device__ __forceinline__ void issue_output(float (&o)[Tr::D / 2],
                                             const uint32_t (&p)[Tr::BN / 16][4], uint32_t sv) {
  constexpr int kC = Tr::kChunkO, kChunks = Tr::D / kC;
  float(&acc)[kChunks][kC / 2] = reinterpret_cast<float(&)[kChunks][kC / 2]>(o);
  const uint64_t dv = detail::gmma_desc(sv, Tr::BN * 128);
  detail::wgmma_async(
      [&] {
#pragma unroll
        for (int kk = 0; kk < Tr::BN / 16; ++kk)
#pragma unroll
          for (int c = 0; c < kChunks; ++c)
            detail::wgmma_rs<1>(
                acc[c], p[kk],
                detail::gmma_advance(dv, detail::mnmajor_step(kk) + c * (kC / 64) * Tr::BN * 128),
                true, T());
      },
      o);
}

// The operand tiles of key block n (flags: its mask flags) taken from their rings and released
// unread, as finish_scores takes them.
template <typename Tr>
__device__ __forceinline__ void skip_operands(const FwdParamsSm90& P, const FwdBarriers<Tr>& bar,
                                              OperandRings<Tr>& operands,
                                              const ConsumerThread& th, int flags) {
  if constexpr (Tr::kBias) {
    if (P.p.bias != nullptr) {
      mbar_wait(bar.bias_full(operands.bias.slot), operands.bias.parity);
      th.release(bar.bias_empty(operands.bias.slot));
      operands.bias.advance();
    }
  }
  if constexpr (Tr::kOperands) {
    if (loads_mask(P.p, flags)) {
      mbar_wait(bar.mask_full(operands.mask.slot), operands.mask.parity);
      th.release(bar.mask_empty(operands.mask.slot));
      operands.mask.advance();
    }
  }
}

// Whether each warpgroup walks only the key blocks its own 64 rows may see (the lengths,
// causality and the window; none for rows past Lq), passing the tile's others: with three
// consumers, whose 192-row tile's last blocks on the diagonal hide every key from its first
// warpgroup, and whose last tile has warpgroups without rows where 192 does not divide Lq.
// Without those GEMMs D = 64 forwards ran 5-12 % faster (H200: causal L4k 0.713 -> 0.631 ms,
// L16k 2.292 -> 2.178); with two consumers the code alone cost the D = 128 bias + mask forward
// 0.8 %.
template <typename Tr>
inline constexpr bool kWarpgroupKeys = Tr::kConsumers == 3;

// The chains of the softmax's reductions (online_softmax). A consumer warp runs its softmax
// nearly alone on its scheduler (the other warpgroup waits on its GEMMs) and waits out the
// latency of each step of a serial chain: four chains, the two rows side by side, took 1.0-1.5 %
// off the dense D = 128 forwards (H200, L4k and L16k, causal or not), none off D = 64; they
// cost D = 256 1 % and the kernels with a mask or bias 0.7-1.3 %, which keep one chain a row.
template <typename Tr>
inline constexpr int kSoftmaxChains = !Tr::kOperands && Tr::D <= 128 ? 4 : 1;

// Whether this warpgroup's rows see block n of the walk (flags: its flags): in kForms kernels
// the block indices' own bit of the warpgroup (mask_forms.cuh: kTileRows), else every block the
// tile's walk yields.
template <typename Tr>
__device__ __forceinline__ bool owns_block(int flags, const ConsumerThread& th) {
  return !Tr::kForms || (flags & (detail::kTileRows << th.wg)) != 0;
}

// A key block this warpgroup's rows cannot see: its turn taken and its ring slots released as
// consume_tile's would be, with no GEMM (the tensor cores are left to the other warpgroups).
template <typename Tr>
__device__ __forceinline__ void pass_block(const FwdParamsSm90& P, int flags,
                                           const FwdBarriers<Tr>& bar, RingPos<Tr::kStages>& ring,
                                           OperandRings<Tr>& operands, const ConsumerThread& th) {
  mbar_wait(bar.k_full(ring.slot), ring.parity);
  take_turn<Tr::kConsumers>(th.wg);
  pass_turn<Tr::kConsumers>(th.wg);
  th.release(bar.k_empty(ring.slot));
  skip_operands<Tr>(P, bar, operands, th, flags);
  mbar_wait(bar.v_full(ring.slot), ring.parity);
  th.release(bar.v_empty(ring.slot));
  ring.advance();
}

// One tile's main loop over the key blocks `walk` yields, from n (flags: its mask flags) on; Q
// is loaded into sQ under bar.q_full with parity q_parity. Leaves the unnormalised O and the
// row state; false where none of the blocks was this warpgroup's (zeros: stored from registers,
// Q released here).
template <typename Tr, typename T, typename Walk>
__device__ __forceinline__ bool consume_tile(const FwdParamsSm90& P, const TileWork& w,
                                             Walk& walk, int n, int flags, uint8_t* smem,
                                             const FwdBarriers<Tr>& bar,
                                             RingPos<Tr::kStages>& ring,
                                             OperandRings<Tr>& operands,
                                             uint32_t q_parity, const ConsumerThread& th,
                                             float (&o)[Tr::D / 2], RowState& st) {
  constexpr int kC = Tr::kConsumers;
  const FwdParams& p = P.p;
  const uint32_t base = detail::smem_u32(smem);
  const uint32_t sq = base + Tr::kOffQ + th.wg * 64 * 128;
  auto k_at = [&](int slot) { return base + Tr::kOffK + slot * Tr::kKVBytes; };
  auto v_at = [&](int slot) { return base + Tr::kOffV + slot * Tr::kKVBytes; };
#pragma unroll
  for (int i = 0; i < Tr::D / 2; ++i) o[i] = 0.f;
  st.reset();

  float s[Tr::BN / 2];
  uint32_t pf[Tr::BN / 16][4];
  float corr[2];

  const GateRows gate = gate_rows<Tr>(P, w, th);
  const auto threshold = threshold_rows<Tr>(P, w, th);
  mbar_wait(bar.q_full(), q_parity);
  int first = w.keys.lo;  // the last block of this warpgroup's (kWarpgroupKeys: others follow)
  if constexpr (kWarpgroupKeys<Tr> || Tr::kForms) {
    int above = w.keys.hi;  // the first block past this warpgroup's
    if constexpr (kWarpgroupKeys<Tr>) {
      // With a sink, every block of the tile (the element test hides what this warpgroup's rows
      // do not see).
      const detail::PositionRule rule = head_rule<Tr>(P, w.hk);
      const detail::BlockRange mine =
          rule.sink > 0
              ? w.keys
              : detail::visible_key_blocks<64, Tr::BN>(w.lens, rule.band, th.wg_row0(w.m0));
      first = max(first, mine.lo);
      above = mine.hi;
    }
    static_assert(Tr::kKeyStep < 0, "warpgroups' own blocks in a walk down the keys");
    for (; n >= first && (n >= above || !owns_block<Tr>(flags, th));
         n = walk.next(n - 1, &flags)) {
      pass_block<Tr>(P, flags, bar, ring, operands, th);
    }
    if (n < first) {  // none of the tile's blocks is this warpgroup's
      for (; n >= w.keys.lo; n = walk.next(n - 1, &flags)) {
        pass_block<Tr>(P, flags, bar, ring, operands, th);
      }
      take_turn<kC>(th.wg);  // the turn of the last P V
      pass_turn<kC>(th.wg);
      th.release(bar.q_empty());
      return false;
    }
  }
  mbar_wait(bar.k_full(ring.slot), ring.parity);
  take_turn<kC>(th.wg);
  issue_scores<Tr, T>(s, sq, k_at(ring.slot));
  pass_turn<kC>(th.wg);
  detail::wgmma_wait<0>();
  detail::fence_operands(s);
  th.release(bar.k_empty(ring.slot));
  finish_scores<Tr, T>(s, P, smem, bar, operands, w, th, n, flags, ring, gate);
  online_softmax<false, kSoftmaxChains<Tr>>(s, st, corr, p.softmax_mul,
                                            probability_weights<Tr>(smem, ring, gate, th));
  pack_probabilities<T>(pf, s);
  // The previous block's V slot: P V multiplies it, or (threshold kernels, after a dropped
  // block: `live` false) it is released unread, as late as P V would have read it. Block-index
  // kernels issue it early, when this warpgroup passes a block (`pending` false after).
  RingPos<Tr::kStages> pv = ring;
  ring.advance();
  bool live = true, pending = true;

  // Key block n: S(n) = Q K^T with the previous block's P V beside it (kWithPv; threshold
  // kernels: none after a dropped block, kDropped; block-index kernels: none after a pass that
  // issued it, kAlone), then S(n)'s scores and softmax. Each kind of step is code of its own:
  // ptxas serialises every wgmma of a kernel where accumulators may be read while a wgmma that
  // writes them can still run, which it cannot rule out across branches on `live` (warnings
  // C7514 / C7517).
  enum StepKind { kWithPv, kDropped, kAlone };
  auto step = [&](auto kind) {
    constexpr bool kPv = decltype(kind)::value == kWithPv;
    mbar_wait(bar.k_full(ring.slot), ring.parity);
    take_turn<kC>(th.wg);
    issue_scores<Tr, T>(s, sq, k_at(ring.slot));
    if constexpr (kPv) {
      mbar_wait(bar.v_full(pv.slot), pv.parity);
      issue_output<Tr, T>(o, pf, v_at(pv.slot));
    }
    pass_turn<kC>(th.wg);

    if constexpr (kPv) {
      detail::wgmma_wait<1>();  // S(n)
    } else {
      if constexpr (decltype(kind)::value == kDropped) {
        mbar_wait(bar.v_full(pv.slot), pv.parity);
        th.release(bar.v_empty(pv.slot));
      }
      detail::wgmma_wait<0>();
    }
    detail::fence_operands(s);
    th.release(bar.k_empty(ring.slot));
    finish_scores<Tr, T>(s, P, smem, bar, operands, w, th, n, flags, ring, gate);
    const bool folds = threshold.folds(s, st, p.softmax_mul, n, th);
    // Kernels with a mask or bias are bound by the consumers' instructions: once the maxima
    // settle, most blocks skip the rescale. The others hide it under the GEMMs, and its test
    // costs them 1-2 % (H200).
    const bool grew = folds && online_softmax<Tr::kOperands, kSoftmaxChains<Tr>>(
                                   s, st, corr, p.softmax_mul,
                                   probability_weights<Tr>(smem, ring, gate, th));

    if constexpr (kPv) {
      detail::wgmma_wait<0>();  // P V
      detail::fence_operands(o);
      th.release(bar.v_empty(pv.slot));
    }
    if (grew) rescale(o, corr);
    if (folds) pack_probabilities<T>(pf, s);
    live = folds;
    pv = ring;
    ring.advance();
  };
  // A block only the other warpgroup's rows see (block-index kernels), after one of this
  // warpgroup's: the pending P V goes in the pass's turn. Held over the pass, its V slot would
  // keep the producer from the passed block's successor, which the next pass waits for.
  auto pass_with_output = [&] {
    mbar_wait(bar.k_full(ring.slot), ring.parity);
    mbar_wait(bar.v_full(pv.slot), pv.parity);
    take_turn<kC>(th.wg);
    issue_output<Tr, T>(o, pf, v_at(pv.slot));
    pass_turn<kC>(th.wg);
    th.release(bar.k_empty(ring.slot));
    detail::wgmma_wait<0>();
    detail::fence_operands(o);
    th.release(bar.v_empty(pv.slot));
    mbar_wait(bar.v_full(ring.slot), ring.parity);
    th.release(bar.v_empty(ring.slot));
    ring.advance();
  };
  using WithPv = std::integral_constant<int, kWithPv>;
  using Dropped = std::integral_constant<int, kDropped>;
  using Alone = std::integral_constant<int, kAlone>;
  auto more = [&](int m) { return Tr::kKeyStep < 0 ? m >= first : walk.holds(m); };
  for (n = walk.after(n, &flags); more(n); n = walk.after(n, &flags)) {
    if (!owns_block<Tr>(flags, th)) {  // only the other warpgroup's rows see it
      if (pending) {
        pass_with_output();
        pending = false;
      } else {
        pass_block<Tr>(P, flags, bar, ring, operands, th);
      }
    } else if (Tr::kForms && !pending) {
      step(Alone{});
      pending = true;
    } else if (!Tr::kThreshold || live) {
      step(WithPv{});
    } else {
      step(Dropped{});
    }
  }

  // Every S GEMM of the tile is done: the next tile's Q may load while the last P V runs.
  if (!Tr::kOutputInQ || P.p.out_f32) th.release(bar.q_empty());  // else after the store
  if (Tr::kForms && !pending) {  // the turn of the last P V, issued already
    take_turn<kC>(th.wg);
    pass_turn<kC>(th.wg);
    return true;
  }
  mbar_wait(bar.v_full(pv.slot), pv.parity);
  take_turn<kC>(th.wg);
  if (!Tr::kThreshold || live) {
    issue_output<Tr, T>(o, pf, v_at(pv.slot));
    pass_turn<kC>(th.wg);
    detail::wgmma_wait<0>();
    detail::fence_operands(o);
  } else {  // the turn of a P V with nothing to multiply
    pass_turn<kC>(th.wg);
  }
  th.release(bar.v_empty(pv.slot));
  if constexpr (kWarpgroupKeys<Tr>) {
    for (; n >= w.keys.lo; n = walk.next(n - 1, &flags)) {
      pass_block<Tr>(P, flags, bar, ring, operands, th);
    }
  }
  return true;
}

}  // namespace dmattn::cuda::sm90
