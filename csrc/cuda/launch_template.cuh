// Host launchers for one (head dim, dtype): tile configurations and kernel launches. Included
// only by csrc/cuda/instantiations/*.cu, each of which instantiates one RunForward/RunBackward.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>

#include "cuda/block_order.cuh"
#include "cuda/bwd_kernel.cuh"
#include "cuda/decode_kernel.cuh"
#include "cuda/dq_kernel.cuh"
#include "cuda/fwd_combine.cuh"
#include "cuda/fwd_kernel.cuh"
#include "cuda/launch.h"
#include "cuda/sm90/bwd_launch.cuh"
#include "cuda/sm90/fwd_launch.cuh"

namespace dmattn::cuda {

// Forward tiles: ForwardTile(D) with 4 warps (each warp owns BM / 4 query rows), and
// kBlockForwardTile for block indices of blocks finer than that (ForwardTileOf).
template <int D>
struct FwdConfig {
  using Traits = FwdTraits<D, ForwardTile(D).bm, ForwardTile(D).bn, 4>;
  using BlockTraits = FwdTraits<D, kBlockForwardTile.bm, kBlockForwardTile.bn, 4>;
};

// Backward tiles: BwdTraits<D, key block BN, query block BM, warps, warp grids of phases A / B /
// C, Q/dO stages> (see bwd_kernel.cuh). `Narrow` (key block 64) replaces `Traits` when
// UseNarrow says so: for grids of the wide tile that would leave SMs idle (few kv heads x
// batches, GQA with one kv head: one CTA per (key block, kv head) walks all the query heads of
// its group), and for block indices of finer blocks (FinerBlocks). Deterministic dq kernel:
// query block x key block, 4 warps of 16 query rows.
template <int D, typename Main, typename NarrowTile = Main>
struct BwdTiles {
  static_assert(Main::BN >= kSmallestBackwardKeyBlock &&
                    NarrowTile::BN >= kSmallestBackwardKeyBlock,
                "the key-block order's workspace (BackwardWorkspaceBytes) counts such blocks");
  using Traits = Main;
  using Narrow = NarrowTile;
  using DqTraits = DqTraits<D, 64, 64, 4>;
};

// The kernel of a call's per-position rules beyond the band: its index masks (IndexKind,
// index_masks.cuh) and whether it has a window table, each combination a template instantiation
// of its own (calls without them compile none of their code). kernel(index, table) names the
// instantiation for a std::integral_constant index and a std::bool_constant table.
template <typename Kernel>
inline auto PickRules(int index, bool table, Kernel kernel) {
  auto with_table = [&](auto index_c) {
    return table ? kernel(index_c, std::true_type{}) : kernel(index_c, std::false_type{});
  };
  switch (index) {
    case kSegmentIds: return with_table(std::integral_constant<int, kSegmentIds>{});
    case kFormsAndIds: return with_table(std::integral_constant<int, kFormsAndIds>{});
    case kGatedForms: return with_table(std::integral_constant<int, kGatedForms>{});
    default: return with_table(std::integral_constant<int, kNoIndex>{});
  }
}

// CTAs of the backward grid for key block BN (one per key block, kv head and dk/dv class).
inline int64_t BackwardCtas(const BwdLaunch& l, int bn) {
  return (l.p.s.seqlen_k + bn - 1) / bn * l.p.s.num_kv_heads * l.p.kv_classes;
}

// sm_80 tiles (mma.sync; also what a Hopper GPU runs without sm_90a kernels). Every tile fits
// sm_80's 163 KB of shared memory.
template <int D, typename Main, typename NarrowTile = Main>
struct BwdTilesSm80 : BwdTiles<D, Main, NarrowTile> {
  static_assert(Main::kSmem + kMaxIndexPrefixSmem <= kSmemLimitSm80 &&
                    NarrowTile::kSmem + kMaxIndexPrefixSmem <= kSmemLimitSm80,
                "backward tiles must fit sm_80, with the index masks' prefix");
  static bool UseNarrow(const BwdLaunch& l) {
    return BackwardCtas(l, Main::BN) < 4 * static_cast<int64_t>(MultiProcessors()) ||
           FinerBlocks(l.p.s, Main::BM, Main::BN);
  }
};
template <int D>
struct BwdConfig;
template <>
struct BwdConfig<32> : BwdTilesSm80<32, BwdTraits<32, 128, 64, 8, 4, 4, 4, 2>> {};
template <>
struct BwdConfig<64> : BwdTilesSm80<64, OffHopper<BwdTraits<64, 128, 64, 8, 4, 4, 4, 2>>> {};
template <>
struct BwdConfig<96> : BwdTilesSm80<96, BwdTraits<96, 64, 64, 8, 4, 4, 4, 2>> {};
template <>
struct BwdConfig<128> : BwdTilesSm80<128, OffHopper<BwdTraits<128, 128, 64, 8, 4, 4, 2, 1>>,
                                     OffHopper<BwdTraits<128, 64, 64, 8, 2, 4, 4, 2>>> {};
template <>
struct BwdConfig<192> : BwdTilesSm80<192, BwdTraits<192, 64, 64, 8, 4, 4, 4, 1>> {};
// (kAllowWgmma false: the same warp grid is wgmma-shaped, and its 64 KB dQ stage would not fit
// sm_80.)
template <>
struct BwdConfig<256>
    : BwdTilesSm80<256, OffHopper<BwdTraits<256, 64, 64, 8, 4, 4, 4, 1, false>>> {};

// sm_90a tiles (wgmma, dQ through bulk reductions) where a head dim has them (the sm_80 tiles of
// that head dim are OffHopper: the sm_90a pass compiles them to a trap). The 64-key tile (two
// stages) serves grids the 128-key one would leave short of CTAs. At D = 128 the 128-key tile
// keeps one stage (H200, tests/cuda/tune_bwd128.cu: two stages are slower, most with a mask)
// and takes a per-query bias too (bias + mask [B,H,L,L] 5.96 ms against 6.24 on the 64-key
// tile; benchmarks/results/logs/bwd_tiles_h200.md). At D = 64 each warpgroup's dQ (and the
// 64-key tile's dK, dV) is half of the head dim: wgmmas of N = 32. D = 256 has the 64-key tile
// alone, its dQ in two chunks of N = 64 per warpgroup.
template <int D, typename Main, typename NarrowTile = Main>
struct BwdTilesSm90 : BwdTiles<D, Main, NarrowTile> {
  static_assert(Main::kWgmma == NarrowTile::kWgmma, "both tiles on wgmma (in sm_90a code)");
  static_assert(Main::kFitsQueryBias && NarrowTile::kFitsQueryBias, "both tiles take any bias");
  static_assert(Main::kSmem + kMaxIndexPrefixSmem <= kSmemLimitSm90 &&
                    NarrowTile::kSmem + kMaxIndexPrefixSmem <= kSmemLimitSm90,
                "and the index masks' prefix");
  static bool UseNarrow(const BwdLaunch& l) {
    return BackwardCtas(l, Main::BN) < 2 * static_cast<int64_t>(MultiProcessors()) ||
           FinerBlocks(l.p.s, Main::BM, Main::BN);
  }
};
template <int D>
struct BwdConfigSm90 : BwdConfig<D> {};
template <>
struct BwdConfigSm90<64> : BwdTilesSm90<64, BwdTraits<64, 128, 64, 8, 8, 8, 4, 2>,
                                        BwdTraits<64, 64, 64, 8, 4, 4, 4, 2>> {};
template <>
struct BwdConfigSm90<128> : BwdTilesSm90<128, BwdTraits<128, 128, 64, 8, 8, 8, 4, 1>,
                                         BwdTraits<128, 64, 64, 8, 4, 4, 4, 2>> {};
template <>
struct BwdConfigSm90<256> : BwdTilesSm90<256, BwdTraits<256, 64, 64, 8, 4, 4, 4, 1>> {};

#if defined(DMATTN_CUDA_TUNING)
// Test builds only: DMATTN_CUDA_VARIANT=<n> (n > 0) runs alternative tiles, defined for some
// (head dim, dtype) pairs in tests/cuda/tune_*.cu; cudaErrorNotSupported elsewhere.
inline int TuningVariant() {
  const char* e = std::getenv("DMATTN_CUDA_VARIANT");
  return e ? std::atoi(e) : 0;
}
template <int D, typename T>
cudaError_t RunForwardVariant(int, const FwdParams&, cudaStream_t) {
  return cudaErrorNotSupported;
}
template <int D, typename T>
cudaError_t RunBackwardVariant(int, const BwdLaunch&, cudaStream_t) {
  return cudaErrorNotSupported;
}
template <>
cudaError_t RunForwardVariant<64, __nv_bfloat16>(int, const FwdParams&, cudaStream_t);
template <>
cudaError_t RunForwardVariant<128, __nv_bfloat16>(int, const FwdParams&, cudaStream_t);
template <>
cudaError_t RunBackwardVariant<64, __nv_bfloat16>(int, const BwdLaunch&, cudaStream_t);
template <>
cudaError_t RunBackwardVariant<128, __nv_bfloat16>(int, const BwdLaunch&, cudaStream_t);
#endif

// Heaviest query blocks first (block_order.cuh) where a mask varying over queries and keys makes
// their work uneven, the forward's `ctas` run in more than one wave and one CTA may visit enough
// tiles (kMinOrderedTiles) for its tail to outlast the ordering kernels; else plain order.
template <typename Tr>
cudaError_t OrderQueryBlocks(FwdParams& p, int64_t ctas, cudaStream_t stream) {
  const int64_t key_tiles = (p.s.seqlen_k + Tr::BN - 1) / Tr::BN;
  if (p.block_order == nullptr || p.mask_map.rows <= 1 || p.mask_map.cols <= 1 ||
      p.m_blocks <= 1 || ctas <= ForwardSlots() || key_tiles < kMinOrderedTiles) {
    p.block_order = nullptr;
    return cudaSuccess;
  }
  const int64_t segments = p.s.batch_count() * p.s.num_heads;
  const int64_t weight_ctas = (segments * p.m_blocks + kWeightWarps - 1) / kWeightWarps;
  fwd_block_weight_kernel<Tr::BM, Tr::BN>
      <<<static_cast<unsigned>(weight_ctas), kWeightWarps * 32, 0, stream>>>(p);
  const int64_t most_cells = static_cast<int64_t>(Tr::BM / kMaskMapCell) * p.mask_map.cols;
  rank_blocks_kernel<kOrderBins><<<static_cast<unsigned>(segments), kOrderThreads, 0, stream>>>(
      p.block_weight, p.block_order, p.m_blocks, most_cells);
  return cudaGetLastError();
}

// The same for the backward's key blocks, whose CTAs (one per SM) run in more than one wave.
template <typename Tr>
cudaError_t OrderKeyBlocks(BwdParams& p, int64_t ctas, cudaStream_t stream) {
  const int64_t pairs = p.kv_members * (p.s.num_heads / p.s.num_kv_heads);
  const int64_t most_tiles = pairs * ((p.s.seqlen_q + Tr::BM - 1) / Tr::BM);
  if (p.block_order == nullptr || p.mask_map.rows <= 1 || p.mask_map.cols <= 1 ||
      p.n_blocks <= 1 || ctas <= MultiProcessors() || most_tiles < kMinOrderedTiles) {
    p.block_order = nullptr;
    return cudaSuccess;
  }
  const int64_t segments = ctas / p.n_blocks;
  const int64_t weight_ctas = (ctas + kWeightWarps - 1) / kWeightWarps;
  bwd_block_weight_kernel<Tr::BM, Tr::BN>
      <<<static_cast<unsigned>(weight_ctas), kWeightWarps * 32, 0, stream>>>(p);
  rank_blocks_kernel<kOrderBins><<<static_cast<unsigned>(segments), kOrderThreads, 0, stream>>>(
      p.block_weight, p.block_order, p.n_blocks, most_tiles);
  return cudaGetLastError();
}

// Merges the partial results of a forward's key splits into out and lse (fwd_combine.cuh).
template <int D, typename T>
cudaError_t CombineSplits(const FwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.s.batch_count() * p.s.num_heads * p.s.seqlen_q;
  const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
  fwd_combine_kernel<D, T>
      <<<static_cast<unsigned>(blocks), kCombineWarps * 32, 0, stream>>>(p, rows);
  return cudaGetLastError();
}

// kFormsOnly: the call has O(L) mask forms (BlockTraits' tiles compile only their kernels);
// kThreshold: softmax-threshold skipping (its kernel alone; the drop map zeroed first).
template <typename Tr, typename T, bool kFormsOnly = false, bool kThreshold = false>
cudaError_t RunForwardTiles(const FwdParams& params, cudaStream_t stream) {
  FwdParams p = params;
  p.m_blocks = static_cast<int>((p.s.seqlen_q + Tr::BM - 1) / Tr::BM);
  const int n_blocks = static_cast<int>((p.s.seqlen_k + Tr::BN - 1) / Tr::BN);
  p.split_blocks = (n_blocks + p.num_splits - 1) / p.num_splits;
  const int64_t blocks =
      static_cast<int64_t>(p.m_blocks) * p.s.batch_count() * p.s.num_heads * p.num_splits;
  if (blocks == 0) return cudaSuccess;
  if (cudaError_t e = OrderQueryBlocks<Tr>(p, blocks, stream); e != cudaSuccess) return e;
  const int index = IndexKindOf(p);  // kFormsOnly: kFormsAndIds or kGatedForms
  auto kernel = PickRules(index, p.windows.heads > 0, [](auto i, auto table) {
    constexpr int kPicked = decltype(i)::value;
    constexpr int kIndex = kFormsOnly && kPicked < kFormsAndIds ? kFormsAndIds : kPicked;
    return fwd_kernel<Tr, T, kIndex, decltype(table)::value, kThreshold>;
  });
  if constexpr (kThreshold) {
    if (cudaError_t e = cudaMemsetAsync(p.drop_map, 0, p.s.drop_map_bytes(), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  const int prefix = IndexPrefixSmem(index);
  if (cudaError_t e = PrepareSmem(kernel, prefix + Tr::kSmem); e != cudaSuccess) return e;
  // The bias and mask tiles come last: without them the CTA needs less (more CTAs per SM).
  const int smem = prefix + (p.mask != nullptr ? Tr::kSmem
                                               : (p.bias != nullptr ? Tr::kOffMask : Tr::kOffBias));
  kernel<<<static_cast<unsigned>(blocks), Tr::kNT, smem, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || p.num_splits == 1) return e;
  return CombineSplits<Tr::D, T>(p, stream);
}

// The decode forward (decode_kernel.cuh): 16, 32 or 64 packed rows a CTA (DecodeRowTile), a
// deeper K/V ring where shared memory allows (DecodeCtasPerSm CTAs of it on one SM).
template <int D>
constexpr int kDecodeStages = D <= 64 ? 4 : 3;

template <typename Tr, typename T>
cudaError_t RunDecodeTiles(const FwdParams& params, cudaStream_t stream) {
  static_assert(Tr::RM == DecodeRowTile(Tr::RM), "the row tile the splits were counted for");
  static_assert(kDecodeMaxQueryRows <= kMaskMapCell, "a CTA's query rows lie in one map cell row");
  FwdParams p = params;
  const AttentionShape& s = p.s;
  const int64_t rows = s.heads_per_kv_head() * s.seqlen_q;
  p.m_blocks = static_cast<int>((rows + Tr::RM - 1) / Tr::RM);
  const int n_blocks = static_cast<int>((s.seqlen_k + Tr::BN - 1) / Tr::BN);
  p.split_blocks = (n_blocks + p.num_splits - 1) / p.num_splits;
  const int64_t blocks = s.batch_count() * s.num_kv_heads * p.m_blocks * p.num_splits;
  if (blocks == 0) return cudaSuccess;
  auto kernel = p.page_table != nullptr ? decode_kernel<Tr, T, true> : decode_kernel<Tr, T, false>;
  if (cudaError_t e = PrepareSmem(kernel, Tr::kSmem); e != cudaSuccess) return e;
  // The last split of each group merges the partial results (without counters: the combine
  // kernel after it, one launch more: 5.6 us of a 0.37 ms call, B8 Lq1 Lk32k H32/Hk8, H100).
  const bool counted = p.num_splits > 1 && p.split_counters != nullptr;
  if (counted) {
    const int64_t groups = blocks / p.num_splits;
    if (cudaError_t e = cudaMemsetAsync(p.split_counters, 0, groups * sizeof(int), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  kernel<<<static_cast<unsigned>(blocks), Tr::kNT, Tr::kSmem, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || p.num_splits == 1 || counted) {
    return e;
  }
  return CombineSplits<Tr::D, T>(p, stream);
}

// The warps split each tile's keys KG ways where the packed rows leave warps to spare.
template <int D, typename T>
cudaError_t RunDecode(const FwdParams& p, cudaStream_t stream) {
  switch (DecodeRowTile(p.s.heads_per_kv_head() * p.s.seqlen_q)) {
    case 16: return RunDecodeTiles<DecodeTraits<D, 4, kDecodeStages<D>>, T>(p, stream);
    case 32: return RunDecodeTiles<DecodeTraits<D, 2, kDecodeStages<D>>, T>(p, stream);
    default: return RunDecodeTiles<DecodeTraits<D, 1, kDecodeStages<D>>, T>(p, stream);
  }
}

// The warp-specialised Hopper forward where the device, the build, the head dim and the call's
// features allow it (sm90::Takes; SetForwardKernel can force the other), else FlashAttention-2
// class.
template <int D, typename T>
cudaError_t RunForward(const FwdParams& params, cudaStream_t stream) {
#if defined(DMATTN_CUDA_TUNING)
  if (const int v = TuningVariant(); v > 0) return RunForwardVariant<D, T>(v, params, stream);
#endif
  if (params.drop_map != nullptr) {  // softmax-threshold skipping (ThresholdTakes: D 64, 128)
    if constexpr (D == 64 || D == 128) {
      if constexpr (sm90::FwdConfig<D>::kAvailable) {
        if (sm90::Takes(params)) {
          using Config = sm90::FwdConfig<D>;
          const cudaError_t e =
              params.mask != nullptr || params.bias != nullptr
                  ? sm90::RunForward<typename Config::ThresholdOperandTraits, T>(params, stream)
                  : sm90::RunForward<typename Config::ThresholdTraits, T>(params, stream);
          if (e != cudaErrorNotSupported) return e;  // else a tensor map failed: run the other
        }
      }
      using Tile = FwdTraits<D, kSkipBlockQ, kSkipBlockK, 4>;
      return RunForwardTiles<Tile, T, false, true>(params, stream);
    }
    return cudaErrorNotSupported;
  }
  if constexpr (HasDecodeForward(D)) {
    if (DecodeTakes(params.s)) return RunDecode<D, T>(params, stream);
  }
  if constexpr (sm90::FwdConfig<D>::kAvailable) {
    if (sm90::Takes(params)) {
      using Config = sm90::FwdConfig<D>;
      const bool operands = params.mask != nullptr || params.bias != nullptr;
      const bool segments = params.q_segments != nullptr;
      const bool table = params.windows.heads > 0;
      cudaError_t e = cudaErrorNotSupported;
      if (params.alpha != nullptr) {  // HopperForwardTakes: D <= 128, nothing else beside it
        if constexpr (D <= 128) {
          e = sm90::RunForward<typename Config::GateTraits, T>(params, stream);
        }
      } else if (params.forms.present) {  // likewise
        if constexpr (D <= 128) {
          e = params.s.block_k % 128 == 0
                  ? sm90::RunForward<typename Config::template FormsTraits<128>, T>(params, stream)
                  : sm90::RunForward<typename Config::template FormsTraits<64>, T>(params, stream);
        }
      } else if (!operands && !segments) {
        e = table ? sm90::RunForward<typename Config::TableTraits, T>(params, stream)
                  : sm90::RunForward<typename Config::Traits, T>(params, stream);
      } else if constexpr (D <= 128) {
        if (table) {
          e = sm90::RunForward<typename Config::OperandTableTraits, T>(params, stream);
        } else if (!segments) {
          e = params.bias != nullptr
                  ? sm90::RunForward<typename Config::OperandTraits, T>(params, stream)
                  : sm90::RunForward<typename Config::MaskTraits, T>(params, stream);
        } else {
          e = operands ? sm90::RunForward<typename Config::OperandSegmentTraits, T>(params, stream)
                       : sm90::RunForward<typename Config::SegmentTraits, T>(params, stream);
        }
      }
      if (e != cudaErrorNotSupported) return e;  // else a tensor map failed: run the other
    }
  }
  using Config = FwdConfig<D>;
  if constexpr (!std::is_same_v<typename Config::Traits, typename Config::BlockTraits>) {
    if (FinerBlocks(params.s, Config::Traits::BM, Config::Traits::BN)) {
      return RunForwardTiles<typename Config::BlockTraits, T, true>(params, stream);
    }
  }
  return RunForwardTiles<typename Config::Traits, T>(params, stream);
}

// The backward's first pass: p.softmax_d = launch.softmax_d = rowsum(dout * out) - dlse.
template <int D, typename T>
cudaError_t RunBackwardPreprocess(const BwdLaunch& launch, BwdParams& p, cudaStream_t stream) {
  const AttentionShape& s = p.s;
  const int64_t rows = s.batch_count() * s.seqlen_q * s.num_heads;
  const int threads = 256;
  const int64_t blocks = (rows * PreprocessLanes(D) + threads - 1) / threads;
  const unsigned grid = static_cast<unsigned>(blocks);
  if (launch.out_f32) {
    bwd_preprocess<D, T><<<grid, threads, 0, stream>>>(p, static_cast<const float*>(launch.out),
                                                       launch.dlse, launch.softmax_d, rows);
  } else {
    bwd_preprocess<D, T><<<grid, threads, 0, stream>>>(p, static_cast<const T*>(launch.out),
                                                       launch.dlse, launch.softmax_d, rows);
  }
  p.softmax_d = launch.softmax_d;
  return cudaGetLastError();
}

// A direct full-size dbias (the main kernel's grid of `ctas` CTAs of BM x BN tiles stores its
// tiles): zeros where no CTA stores one (p.dbias_fill: the band's and the mask's skipped tiles),
// or all of it first.
template <int BM, int BN, typename T>
cudaError_t ZeroDirectDbias(const BwdLaunch& launch, const BwdParams& p, int64_t ctas,
                            cudaStream_t stream) {
  if (p.dbias_fill) {
    bwd_zero_dbias<BM, BN, T><<<static_cast<unsigned>(ctas), kZeroThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if (p.dbias_mode == kDbiasDirect) {
    return cudaMemsetAsync(p.dbias, 0, launch.dbias_elems * sizeof(T), stream);
  }
  return cudaSuccess;
}

// dq = scale * the StagedDq accumulator.
template <int D, typename T>
cudaError_t ConvertStagedDq(const BwdLaunch& launch, const BwdParams& p, cudaStream_t stream) {
  const int64_t n8 = p.s.batch_count() * p.s.seqlen_q * p.s.num_heads * D / 8;
  const int threads = 256;
  const unsigned grid = static_cast<unsigned>((n8 + threads - 1) / threads);
  bwd_dq_convert_staged<D, T><<<grid, threads, 0, stream>>>(p, static_cast<T*>(launch.dq), n8);
  return cudaGetLastError();
}

template <typename Tr, typename DqTr, typename T>
cudaError_t RunBackwardTiles(const BwdLaunch& launch, cudaStream_t stream) {
  constexpr int D = Tr::D;
  BwdParams p = launch.p;
  const AttentionShape& s = p.s;
  const int64_t B = s.batch_count();
  const int64_t q_elems = B * s.seqlen_q * s.num_heads * D;
  if (q_elems == 0) return cudaSuccess;

  // 1. softmax_d = rowsum(dout * out) - dlse
  if (cudaError_t e = RunBackwardPreprocess<D, T>(launch, p, stream); e != cudaSuccess) return e;

  // 2. zero what is accumulated into, and a full-size dbias where the main kernel writes nothing
  p.n_blocks = static_cast<int>((s.seqlen_k + Tr::BN - 1) / Tr::BN);
  const int64_t blocks = static_cast<int64_t>(p.n_blocks) * s.num_kv_heads * p.kv_classes;
  if (p.compute_dq) {
    if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, q_elems * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  if (cudaError_t e = ZeroDirectDbias<Tr::BM, Tr::BN, T>(launch, p, blocks, stream);
      e != cudaSuccess) {
    return e;
  }
  if (p.dbias_mode == kDbiasAtomic) {
    if (cudaError_t e =
            cudaMemsetAsync(p.dbias_accum, 0, launch.dbias_elems * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }

  // 3. main kernel: dk, dv, dbias (and dq through atomics)
  if (cudaError_t e = OrderKeyBlocks<Tr>(p, blocks, stream); e != cudaSuccess) return e;
  {
    const int index = IndexKindOf(p);
    const bool table = p.windows.heads > 0;
    auto kernel_with_bias = [&](auto bias) {
      return PickRules(index, table, [](auto i, auto t) {
        return bwd_kernel<Tr, T, decltype(bias)::value, decltype(i)::value, decltype(t)::value>;
      });
    };
    auto kernel = p.bias != nullptr ? kernel_with_bias(std::true_type{})
                                    : kernel_with_bias(std::false_type{});
    const int smem = IndexPrefixSmem(index) +
                     Tr::SmemBytes(p.mask != nullptr, p.bias != nullptr, s.bias.row_stride == 0);
    if (cudaError_t e = PrepareSmem(kernel, smem); e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(blocks), Tr::kNT, smem, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }

  // 4. dq
  if (p.compute_dq) {
    if constexpr (Tr::kDqStaged) {
      if (cudaError_t e = ConvertStagedDq<D, T>(launch, p, stream); e != cudaSuccess) return e;
    } else {
      const int64_t n8 = q_elems / 8;
      const int threads = 256;
      const unsigned grid = static_cast<unsigned>((n8 + threads - 1) / threads);
      bwd_dq_convert<T><<<grid, threads, 0, stream>>>(p.dq_accum, static_cast<T*>(launch.dq),
                                                      s.scale, n8);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    }
  } else {
    DqParams dp;
    dp.p = p;
    dp.dq = launch.dq;
    dp.m_blocks = static_cast<int>((s.seqlen_q + DqTr::BM - 1) / DqTr::BM);
    const int64_t blocks = static_cast<int64_t>(dp.m_blocks) * B * s.num_heads;
    const int index = IndexKindOf(p);
    auto kernel = PickRules(index, p.windows.heads > 0, [](auto i, auto table) {
      return dq_kernel<DqTr, T, decltype(i)::value, decltype(table)::value>;
    });
    const int smem = IndexPrefixSmem(index) + DqTr::kSmem;
    if (cudaError_t e = PrepareSmem(kernel, smem); e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(blocks), DqTr::kNT, smem, stream>>>(dp);
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

template <typename Cfg, typename T>
cudaError_t RunBackwardConfig(const BwdLaunch& launch, cudaStream_t stream) {
  using Main = typename Cfg::Traits;
  using Narrow = typename Cfg::Narrow;
  if constexpr (!std::is_same_v<Main, Narrow>) {
    if (Cfg::UseNarrow(launch)) {
      return RunBackwardTiles<Narrow, typename Cfg::DqTraits, T>(launch, stream);
    }
  }
  return RunBackwardTiles<Main, typename Cfg::DqTraits, T>(launch, stream);
}

// The warp-specialised Hopper backward (sm90/bwd_launch.cuh) where it takes the call:
// cudaErrorNotSupported when a tensor map cannot describe an operand (the caller then runs the
// FlashAttention-2-class backward).
template <int D, typename T>
cudaError_t RunBackwardSm90(const BwdLaunch& launch, cudaStream_t stream) {
  using Tr = sm90::BwdTraitsSm90<D>;
  using Deterministic = sm90::BwdTraitsSm90<D, 2>;
  using Biased = sm90::BwdTraitsSm90<D, 1, true>;
  using Segmented = sm90::BwdTraitsSm90<D, 1, false, true>;
  using Gated = sm90::BwdTraitsSm90<D, 1, false, false, true>;
  using Formed = sm90::BwdTraitsSm90<D, 1, false, false, false, true>;
  BwdParams p = launch.p;
  const AttentionShape& s = p.s;
  const int64_t q_elems = s.batch_count() * s.seqlen_q * s.num_heads * D;
  if (cudaError_t e = RunBackwardPreprocess<D, T>(launch, p, stream); e != cudaSuccess) return e;
  if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, q_elems * sizeof(float), stream);
      e != cudaSuccess) {
    return e;
  }
  if (p.dq_turns != nullptr) {
    if (cudaError_t e = cudaMemsetAsync(p.dq_turns, 0, DqTurnBytes(s), stream); e != cudaSuccess) {
      return e;
    }
  }
  p.n_blocks = static_cast<int>((s.seqlen_k + Tr::BN - 1) / Tr::BN);
  const int64_t ctas = BackwardCtas(launch, Tr::BN);
  if (cudaError_t e = ZeroDirectDbias<Tr::BM, Tr::BN, T>(launch, p, ctas, stream);
      e != cudaSuccess) {
    return e;
  }
  // A mask's heaviest key blocks first (deterministic calls keep their own order).
  if (p.dq_turns != nullptr) {
    p.block_order = nullptr;
  } else if (cudaError_t e = OrderKeyBlocks<Tr>(p, ctas, stream); e != cudaSuccess) {
    return e;
  }
  auto run = p.dq_turns != nullptr    ? sm90::RunBackwardKernel<Deterministic, T>
             : p.bias != nullptr       ? sm90::RunBackwardKernel<Biased, T>
             : p.q_segments != nullptr ? sm90::RunBackwardKernel<Segmented, T>
             : p.alpha != nullptr      ? sm90::RunBackwardKernel<Gated, T>
             : p.forms.present         ? sm90::RunBackwardKernel<Formed, T>
                                       : sm90::RunBackwardKernel<Tr, T>;
  if (cudaError_t e = run(p, ctas, stream); e != cudaSuccess) return e;
  return ConvertStagedDq<D, T>(launch, p, stream);
}

template <int D, typename T>
cudaError_t RunBackward(const BwdLaunch& launch, cudaStream_t stream) {
#if defined(DMATTN_CUDA_TUNING)
  if (const int v = TuningVariant(); v > 0) return RunBackwardVariant<D, T>(v, launch, stream);
#endif
  if constexpr (sm90::HasHopperBackward(D)) {
    if (HopperKernels() && sm90::Takes(launch)) {
      const cudaError_t e = RunBackwardSm90<D, T>(launch, stream);
      if (e != cudaErrorNotSupported) return e;
    }
  }
  if (HopperKernels()) return RunBackwardConfig<BwdConfigSm90<D>, T>(launch, stream);
  return RunBackwardConfig<BwdConfig<D>, T>(launch, stream);
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_FWD(D, T) \
  template cudaError_t RunForward<D, T>(const FwdParams&, cudaStream_t);
#define DMATTN_INSTANTIATE_BWD(D, T) \
  template cudaError_t RunBackward<D, T>(const BwdLaunch&, cudaStream_t);
