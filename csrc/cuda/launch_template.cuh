// Host launchers for one (head dim, dtype): tile configurations and kernel launches. Included
// only by csrc/cuda/instantiations/*.cu, each of which instantiates one RunForward/RunBackward.
#pragma once

#include <cuda_runtime.h>

#include "cuda/bwd_kernel.cuh"
#include "cuda/dq_kernel.cuh"
#include "cuda/fwd_kernel.cuh"
#include "cuda/launch.h"

namespace dmattn::cuda {

// Forward tiles: BM x BN with NW warps (each warp owns BM / NW query rows).
template <int D>
struct FwdConfig;
template <>
struct FwdConfig<32> { using Traits = FwdTraits<32, 128, 128, 4>; };
template <>
struct FwdConfig<64> { using Traits = FwdTraits<64, 128, 64, 4>; };
template <>
struct FwdConfig<96> { using Traits = FwdTraits<96, 128, 64, 4>; };
template <>
struct FwdConfig<128> { using Traits = FwdTraits<128, 128, 64, 4>; };
template <>
struct FwdConfig<192> { using Traits = FwdTraits<192, 64, 64, 4>; };
template <>
struct FwdConfig<256> { using Traits = FwdTraits<256, 64, 64, 4>; };

// Backward tiles: key block BN, query block BM, NW warps (16 keys per warp; each warp holds
// dK, dV for its keys and D / (NW * 16 / BN) columns in registers).
template <int D>
struct BwdConfig {
  using Traits = BwdTraits<D, (D <= 64 ? 128 : 64), 64, 8>;
  // Deterministic dq kernel: query block x key block, 4 warps of 16 query rows.
  using DqTraits = DqTraits<D, 64, 64, 4>;
};

template <typename Kernel>
inline cudaError_t PrepareSmem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <int D, typename T>
cudaError_t RunForward(const FwdParams& params, cudaStream_t stream) {
  using Tr = typename FwdConfig<D>::Traits;
  FwdParams p = params;
  p.m_blocks = static_cast<int>((p.s.seqlen_q + Tr::BM - 1) / Tr::BM);
  const int64_t blocks = static_cast<int64_t>(p.m_blocks) * p.s.batch_count() * p.s.num_heads;
  if (blocks == 0) return cudaSuccess;
  auto kernel = fwd_kernel<Tr, T>;
  if (cudaError_t e = PrepareSmem(kernel, Tr::kSmem); e != cudaSuccess) return e;
  kernel<<<static_cast<unsigned>(blocks), Tr::kNT, Tr::kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <int D, typename T>
cudaError_t RunBackward(const BwdLaunch& launch, cudaStream_t stream) {
  using Tr = typename BwdConfig<D>::Traits;
  using DqTr = typename BwdConfig<D>::DqTraits;
  BwdParams p = launch.p;
  const AttentionShape& s = p.s;
  const int64_t B = s.batch_count();
  const int64_t q_elems = B * s.seqlen_q * s.num_heads * D;
  if (q_elems == 0) return cudaSuccess;

  // 1. softmax_d = rowsum(dout * out) - dlse
  {
    const int64_t rows = B * s.seqlen_q * s.num_heads;
    const int warps = 8;
    const int64_t blocks = (rows + warps - 1) / warps;
    bwd_preprocess<D, T><<<static_cast<unsigned>(blocks), warps * 32, 0, stream>>>(
        p, static_cast<const T*>(launch.out), launch.dlse, launch.softmax_d, rows);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  p.softmax_d = launch.softmax_d;

  // 2. zero what is accumulated into
  if (p.compute_dq) {
    if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, q_elems * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  if (p.dbias_mode == kDbiasDirect) {
    if (cudaError_t e = cudaMemsetAsync(p.dbias, 0, launch.dbias_elems * sizeof(T), stream);
        e != cudaSuccess) {
      return e;
    }
  } else if (p.dbias_mode == kDbiasAtomic) {
    if (cudaError_t e =
            cudaMemsetAsync(p.dbias_accum, 0, launch.dbias_elems * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }

  // 3. main kernel: dk, dv, dbias (and dq through atomics)
  p.n_blocks = static_cast<int>((s.seqlen_k + Tr::BN - 1) / Tr::BN);
  {
    const int64_t blocks = static_cast<int64_t>(p.n_blocks) * s.num_kv_heads * p.kv_classes;
    auto kernel = bwd_kernel<Tr, T>;
    if (cudaError_t e = PrepareSmem(kernel, Tr::kSmem); e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(blocks), Tr::kNT, Tr::kSmem, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }

  // 4. dq
  if (p.compute_dq) {
    const int64_t n8 = q_elems / 8;
    const int threads = 256;
    bwd_dq_convert<T><<<static_cast<unsigned>((n8 + threads - 1) / threads), threads, 0, stream>>>(
        p.dq_accum, static_cast<T*>(launch.dq), s.scale, n8);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  } else {
    DqParams dp;
    dp.p = p;
    dp.dq = launch.dq;
    dp.m_blocks = static_cast<int>((s.seqlen_q + DqTr::BM - 1) / DqTr::BM);
    const int64_t blocks = static_cast<int64_t>(dp.m_blocks) * B * s.num_heads;
    auto kernel = dq_kernel<DqTr, T>;
    if (cudaError_t e = PrepareSmem(kernel, DqTr::kSmem); e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(blocks), DqTr::kNT, DqTr::kSmem, stream>>>(dp);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }

  // 5. dbias from the fp32 workspace
  if (p.dbias_mode == kDbiasAtomic) {
    const int threads = 256;
    int64_t blocks = (launch.dbias_elems + threads - 1) / threads;
    if (blocks > 65535) blocks = 65535;
    dbias_convert<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        p.dbias_accum, static_cast<T*>(p.dbias), launch.dbias_elems);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_FWD(D, T) \
  template cudaError_t RunForward<D, T>(const FwdParams&, cudaStream_t);
#define DMATTN_INSTANTIATE_BWD(D, T) \
  template cudaError_t RunBackward<D, T>(const BwdLaunch&, cudaStream_t);
