// Warp-specialised Hopper backward (FlashAttention-3 style): one CTA per (key block, kv head,
// dk / dv class), as the FlashAttention-2-class backward's grid.
//
//   warpgroup 0       producer: warp 3 walks the query blocks and queues them for the other
//                     roles (bwd_scheduler.cuh); warp 0 TMA-loads K, V and then Q (with the
//                     mask's bits and the bias tile), dO, lse and D of every queued block into a
//                     two-slot ring (the bias into a ring of three dS slots); warp 1 (warps 1 and
//                     2 in turn, deterministic) adds each block's dQ stage to the fp32
//                     accumulator, one bulk reduction each, and stores a full-size dbias from the
//                     block's dS tile (bwd_producer.cuh)
//   warpgroups 1, 2   consumers (bwd_consumer.cuh): 64 keys each, S^T -> P^T -> dS^T -> dV, dK,
//                     dQ, then the epilogue (bwd_epilogue.cuh)
//
// Calls with lengths, causality or a window, GQA / MQA, dk / dv classes, a mask and a bias (not
// with the deterministic mode; dbias only full-size, without lengths), segment ids, or the gate
// alone (not deterministic), deterministic or not; no O(L) mask forms, window tables or softcap
// (sm90/bwd_launch.cuh: Takes).
#pragma once

#include "cuda/sm90/bwd_epilogue.cuh"

namespace dmattn::cuda::sm90 {

template <typename Tr, typename T>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdParamsSm90 P) {
#if defined(DMATTN_WGMMA)
  extern __shared__ __align__(1024) uint8_t smem[];
  const BwdBarriers<Tr> bar{reinterpret_cast<uint64_t*>(smem + Tr::kOffBarriers)};
  // A dS slot's releases (calls with a bias): every consumer warp, and the dQ warp where it
  // stores a full-size dbias from the slot.
  const int ds_releases = Tr::kReleaseArrivals + (Tr::kBias && P.p.dbias_mode == kDbiasDirect);
  if (threadIdx.x == 0) {
    mbar_init(bar.kv_full(), 1);
    for (int slot = 0; slot < Tr::kStages; ++slot) {
      mbar_init(bar.q_full(slot), Tr::kQFullArrivals);
      mbar_init(bar.q_empty(slot), Tr::kQEmptyArrivals);
      mbar_init(bar.do_full(slot), 1);
      mbar_init(bar.do_empty(slot), Tr::kReleaseArrivals);
    }
    for (int slot = 0; slot < Tr::kDsSlots; ++slot) mbar_init(bar.ds_empty(slot), ds_releases);
    for (int slot = 0; slot < Tr::kQueueSlots; ++slot) {
      mbar_init(bar.queue_full() + slot, 1);
      mbar_init(bar.queue_empty() + slot, Tr::kQueueArrivals);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const BwdCtaWork w = bwd_cta_work<Tr>(P);
  const BlockQueue<Tr> queue = block_queue<Tr>(smem, bar);

  if (threadIdx.x < 128) {
    release_registers<Tr::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (warp == 0) {
      load<Tr>(P, smem, bar, queue, w);
    } else if (warp <= Tr::kDqStages) {
      reduce_dq<Tr>(P, smem, bar, queue, w, warp - 1);
    } else if (warp == 3) {
      schedule<Tr>(P.p, w, queue);
    }
    return;
  }
  claim_registers<Tr::kConsumerRegs>();
  const ConsumerThread th(threadIdx.x - 128);
  // The warpgroup index as the compiler sees a warp-uniform value (its descriptors in uniform
  // registers).
  const int wg = __shfl_sync(0xffffffffu, th.wg, 0);
  float dk[Tr::D / 2], dv[Tr::D / 2];
  consume<Tr, T>(P, smem, bar, queue, w, th, wg, dk, dv);
  store_key_grads<Tr, T>(P, smem, w, th, dk, dv);
#endif
}

}  // namespace dmattn::cuda::sm90
