// Warp-specialised Hopper forward (FlashAttention-3 style), persistent: one CTA per SM.
//
//   warpgroup 0       producer (fwd_producer.cuh): one warp draws the tiles (fwd_scheduler.cuh)
//                     and TMA-loads Q, K, V, bias and mask tiles into mbarrier rings
//   warpgroups 1..    consumers (fwd_consumer.cuh): GEMM -> bias / mask / bounds -> online
//                     softmax -> GEMM on 64 query rows each, then the epilogue (fwd_epilogue.cuh)
//
// The producer gives its registers to the consumers (setmaxnreg). Lengths, causal / window,
// GQA, softcap, lse, a mask and a bias (blocks skipped from the mask block map); split-KV and the
// mask / bias layouts TMA cannot read take the FlashAttention-2-class forward (the dispatcher in
// launch_template.cuh decides).
#pragma once

#include "cuda/sm90/fwd_epilogue.cuh"
#include "cuda/sm90/fwd_producer.cuh"

namespace dmattn::cuda::sm90 {

template <typename Tr, typename T>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParamsSm90 P) {
#if defined(DMATTN_WGMMA)
  extern __shared__ __align__(1024) uint8_t smem[];
  const FwdBarriers<Tr> bar{reinterpret_cast<uint64_t*>(smem + Tr::kOffBarriers)};
  const TileQueue<Tr::kTileSlots> queue{reinterpret_cast<QueuedTile*>(smem + Tr::kOffTileSlots),
                                        bar.tile_full(), bar.tile_empty()};
  if (threadIdx.x == 0) {
    mbar_init(bar.q_full(), 1);
    mbar_init(bar.q_empty(), Tr::kReleaseArrivals);
    for (int slot = 0; slot < Tr::kStages; ++slot) {
      mbar_init(bar.k_full(slot), 1);
      mbar_init(bar.k_empty(slot), Tr::kReleaseArrivals);
      mbar_init(bar.v_full(slot), Tr::kVFullArrivals);
      mbar_init(bar.v_empty(slot), Tr::kReleaseArrivals);
    }
    for (int slot = 0; slot < Tr::kTileSlots; ++slot) {
      mbar_init(queue.full + slot, 1);
      mbar_init(queue.empty + slot, Tr::kReleaseArrivals + (has_operand_warp<Tr>(P) ? 1 : 0));
    }
    for (int slot = 0; slot < Tr::kBiasStages; ++slot) {
      mbar_init(bar.bias_full(slot), 1);
      mbar_init(bar.bias_empty(slot), Tr::kReleaseArrivals);
    }
    for (int slot = 0; slot < Tr::kMaskStages; ++slot) {
      mbar_init(bar.mask_full(slot), 1);
      mbar_init(bar.mask_empty(slot), Tr::kReleaseArrivals);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    release_registers<Tr::kProducerRegs>();
    if (threadIdx.x < 32) {
      produce<Tr>(P, smem, bar, queue);
    } else if constexpr (Tr::kOperands) {
      if (threadIdx.x < 64 && has_operand_warp<Tr>(P)) produce_operands<Tr>(P, smem, bar, queue);
    }
    return;
  }
  claim_registers<Tr::kConsumerRegs>();
  const ConsumerThread th = ConsumerThread::warp_uniform(threadIdx.x - 128);
  // The first consumer takes the first turn at the tensor cores.
  if (th.wg == Tr::kConsumers - 1) pass_turn<Tr::kConsumers>(th.wg);
  RingPos<Tr::kStages> ring;
  OperandRings<Tr> operands;
  RingPos<Tr::kTileSlots> queued;
  uint32_t q_parity = 0;
  float o[Tr::D / 2];
  RowState st;
  for (QueuedTile tile = queue.pop(queued, th.lane); tile.t < P.order.tiles;
       tile = queue.pop(queued, th.lane)) {
    const TileWork& w = tile.work;
    KeyWalk<Tr> walk(P, w);
    int flags;
    const int first = walk.first_block(w, &flags);
    bool busy = walk.holds(first);  // else no key is visible: zeros and lse -inf
    if (busy) {
      busy = consume_tile<Tr, T>(P, w, walk, first, flags, smem, bar, ring, operands, q_parity,
                                 th, o, st);
      q_parity ^= 1;
    } else {
#pragma unroll
      for (int i = 0; i < Tr::D / 2; ++i) o[i] = 0.f;
      st.reset();
    }
    store_tile<Tr, T>(P, w, busy, smem, bar, th, o, st);
  }
  // The last turn handed to the first consumer is taken, so no barrier is left half-arrived.
  if (th.wg == 0) take_turn<Tr::kConsumers>(th.wg);
  if (th.warp == 0 && th.lane == 0) detail::bulk_wait_read();
#endif
}

}  // namespace dmattn::cuda::sm90
