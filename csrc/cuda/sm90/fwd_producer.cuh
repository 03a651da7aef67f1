// Producers of the Hopper forward. One warp walks every tile the CTA runs and its lane 0 issues the
// TMA loads: Q once per tile, then for each visible key block with a visible mask element (last to
// first, or first to last in threshold kernels; the mask block map names them, block_map.cuh) K and
// V, each into its ring slot once the consumers have released it. It draws the tiles and hands them
// to the consumers (fwd_scheduler.cuh), running ahead across tiles: the next tile's Q and first
// blocks load while the consumers finish the current one. The bias and mask tiles of a block (the
// mask's only where the block is not all true) go to rings of their own: in calls with a bias a
// second warp takes the tiles from the same queue and, walking the same blocks, issues them (one
// warp of 24 registers issuing every load was the slower side of the pipeline once a bias streamed
// from memory: 0.94 -> 0.87-0.89 ms with a 50 % mask, H200); otherwise the first warp loads the
// mask tiles with K.
#pragma once

#include "cuda/block_map.cuh"
#include "cuda/sm90/fwd_scheduler.cuh"
#include "cuda/sm90/fwd_traits.cuh"
#include "cuda/sm90/sync.cuh"

namespace dmattn::cuda::sm90 {

// Calls with a bias have an operand warp (the bias and mask loads); others load a mask with K.
template <typename Tr>
__device__ __forceinline__ bool has_operand_warp(const FwdParamsSm90& P) {
  return Tr::kBias && P.p.bias != nullptr;
}

// Key block n loads a mask tile (it has one and is not all true).
__device__ __forceinline__ bool loads_mask(const FwdParams& p, int flags) {
  return p.mask != nullptr && !(flags & detail::kTileAll);
}

// TMA loads of the bias tile, then (unless all true) the tile of the mask's bits of key block n
// into their rings' next slots, each once the consumers have released it.
template <typename Tr>
__device__ __forceinline__ void load_operands(const FwdParamsSm90& P, uint8_t* smem,
                                              const FwdBarriers<Tr>& bar, const TileWork& w,
                                              int n, int flags, OperandRings<Tr>& rings,
                                              bool leader) {
  constexpr int BM = Tr::BM, BN = Tr::BN;
  const FwdParams& p = P.p;
  if (Tr::kBias && p.bias != nullptr) {
    const OperandTiles& o = P.bias_tiles;
    RingPos<Tr::kBiasStages>& pos = rings.bias;
    uint64_t* full = bar.bias_full(pos.slot);
    uint8_t* dst = smem + Tr::kOffBias + pos.slot * Tr::kBiasBytes;
    mbar_wait(bar.bias_empty(pos.slot), pos.parity ^ 1);
    if (leader) {
      mbar_arrive_expect_tx(full, (o.one_row ? 1 : BM) * BN * 2);
      if (o.one_row) {
        tma_load(dst, &P.bias_tma, full, n * BN, 0, w.bias.head, w.bias.batch);
      } else {
#pragma unroll
        for (int panel = 0; panel < BN / 64; ++panel) {
          tma_load(dst + panel * BM * 128, &P.bias_tma, full, n * BN + panel * 64, w.m0,
                   w.bias.head, w.bias.batch);
        }
      }
    }
    pos.advance();
  }
  if (loads_mask(p, flags)) {
    const OperandTiles& o = P.mask_tiles;
    RingPos<Tr::kMaskStages>& pos = rings.mask;
    mbar_wait(bar.mask_empty(pos.slot), pos.parity ^ 1);
    if (leader) {
      mbar_arrive_expect_tx(bar.mask_full(pos.slot), (o.one_row ? 1 : BM) * BN / 8);
      tma_load(smem + Tr::kOffMask + pos.slot * Tr::kMaskBytes, &P.mask_tma,
               bar.mask_full(pos.slot), n * BN / 8, o.one_row ? 0 : w.m0, w.mask.head,
               w.mask.batch);
    }
    pos.advance();
  }
}

// The gate's delta of key block n (BN floats, zeros past the last key) into ring slot `slot`
// by the producer warp's lanes, each arriving on the slot's v_full once its cp.async has landed
// (kVFullArrivals). TMA cannot box one kv head's column of delta [Lk, Hk]: 4 bytes a row, under
// its 16-byte minimum.
template <typename Tr>
__device__ __forceinline__ void load_delta(const FwdParams& p, uint8_t* smem, uint64_t* full,
                                           int slot, const TileWork& w, int n) {
  constexpr int kPerLane = Tr::BN / 32;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int kv_heads = static_cast<int>(p.s.num_kv_heads);
  const int keys = static_cast<int>(p.s.seqlen_k);
  const float* delta = p.delta + p.s.delta_offset(w.b, w.hk);
  const uint32_t dst = smem_u32(smem + Tr::kOffDelta + slot * Tr::kDeltaBytes);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int key = lane * kPerLane + i, j = n * Tr::BN + key;
    const bool in = j < keys;
    detail::cp_async4(dst + 4 * key, in ? delta + static_cast<int64_t>(j) * kv_heads : delta,
                      in ? 4 : 0);
  }
  mbar_arrive_on_cp_async(full);
}

// A tile with work: its first block n (mask flags `flags`), the rest from `walk`.
template <typename Tr, typename Walk>
__device__ __forceinline__ void produce_tile(const FwdParamsSm90& P, uint8_t* smem,
                                             const FwdBarriers<Tr>& bar, const TileWork& w,
                                             Walk& walk, int n, int flags,
                                             RingPos<Tr::kStages>& ring,
                                             OperandRings<Tr>& operands, uint32_t q_parity,
                                             bool leader) {
  constexpr int BM = Tr::BM, BN = Tr::BN;
  const FwdParams& p = P.p;
  const int kv_entry = static_cast<int>(p.s.kv_offset(w.b, 0) / P.kv_entry_elems);

  mbar_wait(bar.q_empty(), q_parity ^ 1);
  if (leader) {
    mbar_arrive_expect_tx(bar.q_full(), Tr::kQBytes);
#pragma unroll
    for (int panel = 0; panel < Tr::kPanels; ++panel) {
      tma_load(smem + Tr::kOffQ + panel * BM * 128, &P.q_tma, bar.q_full(), panel * 64, w.h, w.m0,
               static_cast<int>(w.b));
    }
  }

  // The K or V tile of block n into its ring slot once the consumers have released it.
  auto load_rows = [&](uint32_t offset, const CUtensorMap* map, uint64_t* full, uint64_t* empty,
                       int n) {
    mbar_wait(empty, ring.parity ^ 1);
    if (!leader) return;
    mbar_arrive_expect_tx(full, Tr::kKVBytes);
#pragma unroll
    for (int panel = 0; panel < Tr::kPanels; ++panel) {
      tma_load(smem + offset + panel * BN * 128, map, full, panel * 64, w.hk, n * BN, kv_entry);
    }
  };
  const bool operands_here = Tr::kOperands && !has_operand_warp<Tr>(P);
  for (; walk.holds(n); n = walk.after(n, &flags)) {
    const int slot = ring.slot;
    load_rows(Tr::kOffK + slot * Tr::kKVBytes, &P.k_tma, bar.k_full(slot), bar.k_empty(slot), n);
    if (operands_here) load_operands<Tr>(P, smem, bar, w, n, flags, operands, leader);
    load_rows(Tr::kOffV + slot * Tr::kKVBytes, &P.v_tma, bar.v_full(slot), bar.v_empty(slot), n);
    if constexpr (Tr::kGate) load_delta<Tr>(p, smem, bar.v_full(slot), slot, w, n);
    ring.advance();
  }
}

// Run by the whole producer warp (the mask map walk is warp-wide); lane 0 issues.
template <typename Tr>
__device__ __forceinline__ void produce(const FwdParamsSm90& P, uint8_t* smem,
                                        const FwdBarriers<Tr>& bar,
                                        const TileQueue<Tr::kTileSlots>& queue) {
  const bool leader = (threadIdx.x & 31) == 0;
  if (leader) {
    tma_prefetch_descriptor(&P.q_tma);
    tma_prefetch_descriptor(&P.k_tma);
    tma_prefetch_descriptor(&P.v_tma);
  }
  RingPos<Tr::kStages> ring;
  OperandRings<Tr> operands;
  RingPos<Tr::kTileSlots> queued;
  uint32_t q_parity = 0;
  for (int64_t t = blockIdx.x;;) {
    if (t >= P.order.tiles) {
      if (leader) queue.push(queued, {t, {}});
      break;
    }
    const TileWork w = tile_work<Tr>(P, t);
    if (leader) queue.push(queued, {t, w});
    KeyWalk<Tr> walk(P, w);
    int flags;
    const int first = walk.first_block(w, &flags);
    if (walk.holds(first)) {
      produce_tile<Tr>(P, smem, bar, w, walk, first, flags, ring, operands, q_parity, leader);
      q_parity ^= 1;
    }
    const int64_t next = leader ? next_tile(P.order, t) : 0;
    t = __shfl_sync(0xffffffffu, next, 0);
  }
}

// The operand warp (has_operand_warp): the bias and mask tiles of every block the consumers will
// run, tile by tile as the queue hands them out.
template <typename Tr>
__device__ __forceinline__ void produce_operands(const FwdParamsSm90& P, uint8_t* smem,
                                                 const FwdBarriers<Tr>& bar,
                                                 const TileQueue<Tr::kTileSlots>& queue) {
  static_assert(Tr::kOperands, "only kernels with operand rings");
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    if (P.p.bias != nullptr) tma_prefetch_descriptor(&P.bias_tma);
    if (P.p.mask != nullptr) tma_prefetch_descriptor(&P.mask_tma);
  }
  OperandRings<Tr> rings;
  RingPos<Tr::kTileSlots> queued;
  for (QueuedTile tile = queue.pop(queued, lane); tile.t < P.order.tiles;
       tile = queue.pop(queued, lane)) {
    const TileWork& w = tile.work;
    KeyWalk<Tr> walk(P, w);
    int flags;
    for (int n = walk.first_block(w, &flags); walk.holds(n); n = walk.after(n, &flags)) {
      load_operands<Tr>(P, smem, bar, w, n, flags, rings, lane == 0);
    }
  }
}

}  // namespace dmattn::cuda::sm90
