// Producer of the Hopper forward: one thread issues the TMA loads of every tile the CTA runs,
// Q once per tile, then K and V of each visible key block (last to first) into the ring's slots,
// each load waiting for its slot to be released by the consumers. It draws the tiles and hands
// them to the consumers (fwd_scheduler.cuh), running ahead across tiles: the next tile's Q and
// first blocks load while the consumers finish the current one.
#pragma once

#include "cuda/sm90/fwd_scheduler.cuh"
#include "cuda/sm90/fwd_traits.cuh"
#include "cuda/sm90/sync.cuh"

namespace dmattn::cuda::sm90 {

template <typename Tr>
__device__ __forceinline__ void produce(const FwdParamsSm90& P, uint8_t* smem,
                                        const FwdBarriers<Tr>& bar,
                                        const TileQueue<Tr::kTileSlots>& queue) {
  constexpr int BM = Tr::BM, BN = Tr::BN;
  tma_prefetch_descriptor(&P.q_map);
  tma_prefetch_descriptor(&P.k_map);
  tma_prefetch_descriptor(&P.v_map);
  RingPos<Tr::kStages> ring;
  RingPos<Tr::kTileSlots> queued;
  uint32_t q_parity = 0;
  for (int64_t t = blockIdx.x;; t = next_tile(P.order, t)) {
    queue.push(queued, t);
    if (t >= P.order.tiles) break;
    const TileWork w = tile_work<BM, BN>(P, t);
    if (w.empty()) continue;
    const int kv_entry = static_cast<int>(P.p.s.kv_offset(w.b, 0) / P.kv_entry_elems);

    mbar_wait(bar.q_empty(), q_parity ^ 1);
    mbar_arrive_expect_tx(bar.q_full(), Tr::kQBytes);
#pragma unroll
    for (int panel = 0; panel < Tr::kPanels; ++panel) {
      tma_load(smem + Tr::kOffQ + panel * BM * 128, &P.q_map, bar.q_full(), panel * 64, w.h, w.m0,
               static_cast<int>(w.b));
    }
    q_parity ^= 1;

    for (int n = w.keys.hi - 1; n >= w.keys.lo; --n) {
      const uint32_t k_slot = Tr::kOffK + ring.slot * Tr::kKVBytes;
      const uint32_t v_slot = Tr::kOffV + ring.slot * Tr::kKVBytes;
      mbar_wait(bar.k_empty(ring.slot), ring.parity ^ 1);
      mbar_arrive_expect_tx(bar.k_full(ring.slot), Tr::kKVBytes);
#pragma unroll
      for (int panel = 0; panel < Tr::kPanels; ++panel) {
        tma_load(smem + k_slot + panel * BN * 128, &P.k_map, bar.k_full(ring.slot), panel * 64,
                 w.hk, n * BN, kv_entry);
      }
      mbar_wait(bar.v_empty(ring.slot), ring.parity ^ 1);
      mbar_arrive_expect_tx(bar.v_full(ring.slot), Tr::kKVBytes);
#pragma unroll
      for (int panel = 0; panel < Tr::kPanels; ++panel) {
        tma_load(smem + v_slot + panel * BN * 128, &P.v_map, bar.v_full(ring.slot), panel * 64,
                 w.hk, n * BN, kv_entry);
      }
      ring.advance();
    }
  }
}

}  // namespace dmattn::cuda::sm90
