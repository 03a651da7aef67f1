// Epilogue of the Hopper forward: one consumer warpgroup normalises its 64 rows of O and writes
// them with lse. A bf16 / fp16 out goes through shared memory and leaves by one TMA store per
// 64-column panel (rows past Lq are clipped by the tensor map); a float32 out (the backward's
// residual) and the zeros of a tile without work are stored straight from the registers. Where
// O is staged in Q's tile, the tile is released to the producer once the store has read it.
#pragma once

#include <cmath>
#include <type_traits>

#include "cuda/sm90/fwd_consumer.cuh"

namespace dmattn::cuda::sm90 {

// O / l straight from the registers to global memory, two columns per store.
template <typename Tr, typename Out>
__device__ __forceinline__ void store_from_registers(const FwdParams& p, const TileWork& w,
                                                     const ConsumerThread& th,
                                                     const float (&o)[Tr::D / 2],
                                                     const float (&inv_l)[2]) {
  const AttentionShape& s = p.s;
  Out* dst = static_cast<Out*>(p.out) + s.q_offset(w.b, w.h);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = th.row0(w.m0) + 8 * half;
    if (i >= s.seqlen_q) continue;
#pragma unroll
    for (int t = 0; t < Tr::NTO; ++t) {
      const float x0 = o[4 * t + 2 * half] * inv_l[half];
      const float x1 = o[4 * t + 2 * half + 1] * inv_l[half];
      Out* at = dst + i * s.q_row_stride() + t * 8 + 2 * th.tq;
      if constexpr (std::is_same_v<Out, float>) {
        *reinterpret_cast<float2*>(at) = make_float2(x0, x1);
      } else {
        *reinterpret_cast<uint32_t*>(at) = detail::Elem<Out>::pack(x0, x1);
      }
    }
  }
}

template <typename Tr, typename T>
__device__ __forceinline__ void store_tile(const FwdParamsSm90& P, const TileWork& w,
                                           bool busy, uint8_t* smem, const FwdBarriers<Tr>& bar,
                                           const ConsumerThread& th,
                                           const float (&o)[Tr::D / 2], const RowState& st) {
  using E = detail::Elem<T>;
  const FwdParams& p = P.p;
  const AttentionShape& s = p.s;
  const int Lq = static_cast<int>(s.seqlen_q);
  float inv_l[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = st.l[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv_l[half] = l > 0.f ? 1.f / l : 0.f;
    const int i = th.row0(w.m0) + 8 * half;
    if (th.tq == 0 && i < Lq) {
      p.lse[s.lse_offset(w.b, w.h) + i] =
          l > 0.f ? st.m[half] * p.lse_mul + logf(l) : -INFINITY;
    }
  }

  // A float32 out, and a tile without work (its zeros must not go through the stage: where O
  // is staged in Q's tile, the producer may be loading the next tile's Q there already).
  if (p.out_f32) return store_from_registers<Tr, float>(p, w, th, o, inv_l);
  if (!busy) return store_from_registers<Tr, T>(p, w, th, o, inv_l);

  T* so = reinterpret_cast<T*>(smem + Tr::kOffO);
  const bool issuer = th.warp == 0 && th.lane == 0;
  if (issuer) detail::bulk_wait_read();  // the previous tile's store has read the stage
  named_sync(kEpilogueBarrier + th.wg, 128);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const SwizzledPairs<Tr::BM> pairs(th.tile_row(half), th.tq);
#pragma unroll
    for (int t = 0; t < Tr::NTO; ++t) {
      *reinterpret_cast<uint32_t*>(so + pairs(t)) =
          E::pack(o[4 * t + 2 * half] * inv_l[half], o[4 * t + 2 * half + 1] * inv_l[half]);
    }
  }
  detail::fence_async_shared();
  named_sync(kEpilogueBarrier + th.wg, 128);
  if (issuer) {
#pragma unroll
    for (int panel = 0; panel < Tr::kPanels; ++panel) {
      tma_store(&P.o_tma, smem + Tr::kOffO + panel * Tr::BM * 128 + th.wg * 64 * 128, panel * 64,
                w.h, th.wg_row0(w.m0), static_cast<int>(w.b));
    }
    detail::bulk_commit();
    if constexpr (Tr::kOutputInQ) {  // Q's tile is free once the store has read it: 4 warps
      detail::bulk_wait_read();
      mbar_arrive(bar.q_empty(), 4);
    }
  }
}

}  // namespace dmattn::cuda::sm90
