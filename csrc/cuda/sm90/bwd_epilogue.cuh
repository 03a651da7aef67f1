// Epilogue of the Hopper backward: dK (scaled) and dV of the block's keys, staged through the K
// and V tiles (free once both consumers' last GEMMs are done) and stored in 16-byte rows.
#pragma once

#include "cuda/sm90/bwd_consumer.cuh"

namespace dmattn::cuda::sm90 {

template <typename Tr, typename T>
__device__ __forceinline__ void store_key_grads(const BwdParamsSm90& P, uint8_t* smem,
                                                const BwdCtaWork& w, const ConsumerThread& th,
                                                const float (&dk)[Tr::D / 2],
                                                const float (&dv)[Tr::D / 2]) {
  using E = detail::Elem<T>;
  using Tile = detail::SwizzledTile<Tr::BN, Tr::D>;
  const BwdParams& p = P.p;
  const AttentionShape& s = p.s;
  T* sK = reinterpret_cast<T*>(smem + Tr::kOffK);
  T* sV = reinterpret_cast<T*>(smem + Tr::kOffV);
  named_sync(kBwdEpilogueBarrier, kConsumerThreads);  // every GEMM reading K, V is done
  const int r = th.wg * Tr::kKeys + 16 * th.warp + th.g;
#pragma unroll
  for (int t = 0; t < Tr::D / 8; ++t) {
    const int c = 8 * t + 2 * th.tq;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float* k = dk + 4 * t + 2 * half;
      const float* v = dv + 4 * t + 2 * half;
      *reinterpret_cast<uint32_t*>(sK + Tile::off(r + 8 * half, c)) =
          E::pack(k[0] * p.scale, k[1] * p.scale);
      *reinterpret_cast<uint32_t*>(sV + Tile::off(r + 8 * half, c)) = E::pack(v[0], v[1]);
    }
  }
  named_sync(kBwdEpilogueBarrier, kConsumerThreads);
  const int64_t b_rep = detail::batch_of(p, w.cta.cls, 0);
  const int64_t kv_rs = s.kv_row_stride();
  const int64_t off = p.dkv_batch.offset(s.batch, b_rep) + static_cast<int64_t>(w.cta.hk) * Tr::D +
                      static_cast<int64_t>(w.n0) * kv_rs;
  const int rows = static_cast<int>(s.seqlen_k) - w.n0;
  const int tid = threadIdx.x - 128;
  detail::store_tile<Tr::BN, Tr::D, kConsumerThreads>(static_cast<T*>(p.dk) + off, sK, kv_rs, rows,
                                                      tid);
  detail::store_tile<Tr::BN, Tr::D, kConsumerThreads>(static_cast<T*>(p.dv) + off, sV, kv_rs, rows,
                                                      tid);
}

}  // namespace dmattn::cuda::sm90
