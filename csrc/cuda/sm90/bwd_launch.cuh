// Host launcher of the warp-specialised Hopper backward's main kernel (included by
// launch_template.cuh, which runs the preprocess before it and the dQ conversion after it).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/index_masks.cuh"
#include "cuda/launch.h"
#include "cuda/sm90/bwd_kernel.cuh"
#include "cuda/sm90/fwd_launch.cuh"
#include "cuda/sm90/tensor_maps.h"

namespace dmattn::cuda::sm90 {

// Head dims with a warp-specialised Hopper backward; the dispatcher runs it by default at each
// (H100 harness against the FlashAttention-2-class backward, dense L4k: D = 128 B4 H16 2.63 vs
// 3.68 ms, causal 1.55 vs 2.16; D = 64 B4 H32 3.98 vs 4.16, causal 2.23 vs 2.42).
constexpr bool HasHopperBackward(int D) { return D == 64 || D == 128; }

// True when the kernel takes the call: dense attention with lengths, causality or a window, GQA /
// MQA, a mask, a bias, segment ids, the gate or block indices of whole tiles (no other O(L) mask
// forms, window table or softcap; the gate and the block indices alone, the gate with or
// without its threshold), dQ through the
// accumulator (deterministic calls: in turns, with the flags of the workspace), operands TMA can
// address. The FlashAttention-2-class backward runs the rest.
inline bool Takes(const BwdLaunch& l) {
  const BwdParams& p = l.p;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int D = static_cast<int>(p.s.head_dim);
  const BackwardKernel setting = BackwardKernelSetting();
  // A mask as the forward reads it (its bits by rows, not broadcast over keys), beside one dQ
  // stage (BwdTraitsSm90::kMasks).
  const bool mask_ok = p.mask == nullptr || (p.s.mask.col_stride == 1 && p.compute_dq);
  // A bias as the forward reads it (rows of whole 16-byte chunks: Lk % 8 == 0; a tile, or one
  // row when it is broadcast over queries), beside one dQ stage; its dbias none, or full-size in
  // 16-byte rows without lengths (stored from the dS tiles: dbias_staged).
  const bool dbias_ok =
      p.dbias_mode == kDbiasNone || (p.dbias_mode == kDbiasDirect && p.dbias_staged);
  const bool bias_ok = p.bias == nullptr || (p.s.bias.col_stride == 1 && p.s.seqlen_k % 8 == 0 &&
                                             aligned(p.bias) && p.compute_dq && dbias_ok);
  // Segment ids as mask bits the loader writes (kBlockIndexed): beside one dQ stage, with no
  // mask or bias (BwdTraitsSm90::kSegments).
  const bool segments_ok =
      IndexKindOf(p) == kNoIndex || (IndexKindOf(p) == kSegmentIds && p.mask == nullptr &&
                                     p.bias == nullptr && p.compute_dq);
  // The gate (BwdTraitsSm90::kGate) without a mask, bias, segment ids or mask forms, beside one
  // dQ stage (its gradients by atomics: not in the deterministic mode's order), with a positive
  // scale (the factored gate's bound in units of 1 / scale, bwd_consumer.cuh: gate_scores_t).
  const bool gate_ok = IndexKindOf(p) == kGatedForms && p.mask == nullptr && p.bias == nullptr &&
                       p.q_segments == nullptr && !p.forms.present && p.compute_dq &&
                       p.bias_mul > 0.f;
  // Block indices alone of whole 64 x 128 tiles (BwdTraitsSm90::kForms) beside one dQ stage.
  const bool forms_ok = IndexKindOf(p) == kFormsAndIds && BlockIndicesHoldTiles(p.s, 64, 128) &&
                        p.mask == nullptr && p.bias == nullptr && p.q_segments == nullptr &&
                        p.compute_dq;
  return setting != BackwardKernel::kFlash2 && HasHopperBackward(D) && mask_ok && bias_ok &&
         (segments_ok || gate_ok || forms_ok) &&
         p.windows.heads == 0 && p.softcap == 0.f && p.dq_accum != nullptr &&
         (p.compute_dq || p.dq_turns != nullptr) && p.s.seqlen_q > 0 &&
         p.s.seqlen_k > 0 && p.s.batch_count() > 0 && aligned(p.q) && aligned(p.k) &&
         aligned(p.v) && aligned(p.dout);
}

// The main kernel over `p` (softmax_d computed, dq_accum zeroed; dq in StagedDq's layout).
template <typename Tr, typename T>
cudaError_t RunBackwardKernel(const BwdParams& p, int64_t ctas, cudaStream_t stream) {
  const AttentionShape& s = p.s;
  BwdParamsSm90 P{};
  P.p = p;
  P.kv_entry_elems = s.seqlen_k * s.num_kv_heads * s.head_dim;
  // As many slots as run at once, each its n_blocks CTAs.
  P.chain_slots = static_cast<int>(
      std::max<int64_t>(1, (MultiProcessors() + p.n_blocks / 2) / int64_t{p.n_blocks}));
  const int64_t B = s.batch_count();
  const int64_t kv_entries = KvEntries(s);
  cudaError_t e = EncodeRowMajorMap(&P.q_tma, p.q, s.dtype, B, s.seqlen_q, s.num_heads, Tr::D,
                                    Tr::BM);
  if (e == cudaSuccess) {
    e = EncodeRowMajorMap(&P.do_tma, p.dout, s.dtype, B, s.seqlen_q, s.num_heads, Tr::D, Tr::BM);
  }
  if (e == cudaSuccess) {
    e = EncodeRowMajorMap(&P.k_tma, p.k, s.dtype, kv_entries, s.seqlen_k, s.num_kv_heads, Tr::D,
                          Tr::BN);
  }
  if (e == cudaSuccess) {
    e = EncodeRowMajorMap(&P.v_tma, p.v, s.dtype, kv_entries, s.seqlen_k, s.num_kv_heads, Tr::D,
                          Tr::BN);
  }
  const int64_t rows = B * s.num_heads * s.seqlen_q;  // of lse and D
  if (e == cudaSuccess) e = EncodeVectorMap(&P.lse_tma, p.lse, rows, Tr::kRowBox);
  if (e == cudaSuccess) e = EncodeVectorMap(&P.dsum_tma, p.softmax_d, rows, Tr::kRowBox);
  if (e == cudaSuccess && p.mask != nullptr) {
    e = EncodeMaskBitsMap(&P.mask_tma, &P.mask_tiles, s, p.mask_map.bits, Tr::BM, Tr::BN);
  }
  if (e == cudaSuccess && p.bias != nullptr) {
    e = EncodeBiasMap(&P.bias_tma, &P.bias_tiles, s, s.bias, p.bias, Tr::BM, Tr::BN);
  }
  if (e == cudaSuccess && p.dbias_mode == kDbiasDirect) {
    e = EncodeBiasMap(&P.dbias_tma, &P.dbias_tiles, s, p.dbias_op, p.dbias, Tr::BM, Tr::BN);
  }
  if (e != cudaSuccess) return e;
  auto kernel = bwd_kernel<Tr, T>;
  if (cudaError_t e2 = PrepareSmem(kernel, Tr::kSmem); e2 != cudaSuccess) return e2;
  kernel<<<static_cast<unsigned>(ctas), Tr::kThreads, Tr::kSmem, stream>>>(P);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda::sm90
