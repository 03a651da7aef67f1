// Forward kernel: FlashAttention-2 style, one CTA per (key split, query block, head, batch).
// A (batch, head)'s query blocks start from the last one (the most keys under causality), or in
// the order of block_order.cuh (most non-empty tiles first) when the mask varies over both axes.
//
// Per key block n (walked from the last visible block down to the first; up from the first in
// the softmax-threshold kernels, kThreshold):
//   S = bias / scale + Q K^T            (accumulator initialised from the bias tile)
//   softcap, then -inf where not visible (mask, lengths, diagonal window)
//   online softmax in fp32 with exp2, O += P V
// K/V/bias/mask tiles stream through cp.async (K, bias and mask of the next block load while
// P V of this one runs, V while Q K^T runs). The analytic bounds (lengths, causal/window) limit
// the key-block range; within it the mask block map names the next block with any true element
// (all-false blocks cost no loads and no GEMMs), and all-true blocks skip the mask tile and the
// per-element test. With split-KV each CTA walks one slice of the key blocks and leaves a partial
// result for fwd_combine.cuh. With index masks (kIndex: segment ids, key / row ranges, block
// indices) the walk also skips the blocks they hide, and blocks they leave partly visible test
// each score (index_masks.cuh). With a window table (kTable) the range is the kv head's band
// and its sink's blocks, the walk stepping over the gap between them. Gated calls (gate.cuh) run
// kernels of their own (kGatedForms, the forms' code too): the scores gain the gate's term with
// the bias, and the walk passes over the grid blocks the gate threshold drops. The
// softmax-threshold kernels (kThreshold: a 64 x 128 tile, one block of the rule's grid; index
// masks, window tables, a gate without its threshold) walk up the key blocks as the rule visits
// them (a block the walk skips holds no visible score, which the rule neither keeps nor drops)
// and, once S(n) is scored, vote over the CTA (threshold.cuh): a dropped block gets no softmax and
// no P V, and its byte of the drop map is set over the launcher's zeros.
//
// The two GEMMs (scores_gemm, output_gemm) run on mma.sync, or on sm_90a with wgmma when the
// tile is one warpgroup of 16-row warps (kWgmma): the accumulators have the same layout either
// way, so masking and softmax do not know which ran.
#pragma once

#include <cmath>

#include "cuda/block_map.cuh"
#include "cuda/gate.cuh"
#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/index_masks.cuh"
#include "cuda/sm90.cuh"
#include "cuda/threshold.cuh"

namespace dmattn::cuda {

// kAllowWgmma = false keeps mma.sync on sm_90a too (for side-by-side timing).
template <int D_, int BM_, int BN_, int NW_, bool kAllowWgmma = true>
struct FwdTraits {
  static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
  static constexpr int kNT = NW * 32;
  static constexpr int kRowsPerWarp = BM / NW;
  static constexpr int MT = kRowsPerWarp / 16;  // 16-row MMA tiles per warp
  static constexpr int NTS = BN / 8;            // 8-col tiles of S
  static constexpr int NTO = D / 8;             // 8-col tiles of O
  static_assert(kRowsPerWarp % 16 == 0, "each warp owns a multiple of 16 query rows");
  static_assert(BN % 16 == 0 && D % 32 == 0, "tile shapes");
  // wgmma: one warpgroup of 16-row warps; Q, K, V in 128-byte-swizzled panels (D % 64 == 0);
  // N = BN for S (64 or 128) and D in chunks of 128 or 64 columns for O.
  static constexpr bool kWgmmaShape =
      NW == 4 && kRowsPerWarp == 16 && D % 64 == 0 && (BN == 64 || BN == 128);
#if defined(DMATTN_WGMMA)
  static constexpr bool kWgmma = kAllowWgmma && kWgmmaShape;
#else
  static constexpr bool kWgmma = false;
#endif
  static constexpr int kChunkO = D % 128 == 0 ? 128 : 64;

  // Registers to spare (D <= 128): the mask map walk keeps its 32 tiles' flags from step to
  // step, and bias / mask tiles load one fixed column chunk per thread (load_operand_tile; H200
  // harness, bias + mask [B,H,L,L] L4k forward 0.96 -> 0.88 ms). The D256 forward (255
  // registers, spilling) ran slower with either: 0.71 -> 0.84 ms with the kept walk, +18 % with
  // the loads. Wider tiles walk afresh at every step and load in the plain loop.
  static constexpr bool kSpareRegisters = D <= 128;

  static constexpr int kBiasPitch = BN + 8;   // elements (keeps 16-byte rows, no bank conflicts)
  static constexpr int kMaskPitch = BN + 16;  // bytes

  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + BM * D * 2;
  static constexpr int kOffV = kOffK + BN * D * 2;
  static constexpr int kOffBias = kOffV + BN * D * 2;
  static constexpr int kOffMask = kOffBias + BM * kBiasPitch * 2;
  static constexpr int kMaskTile = BM * kMaskPitch;
  static constexpr int kSmem = kOffMask + kMaskTile;
  static_assert(kOffK % 1024 == 0 && kOffV % 1024 == 0, "wgmma operands on 1024-byte boundaries");
};

namespace detail {

// cp.async writes to shared memory are visible to every thread's GEMM after this.
template <typename Tr>
__device__ __forceinline__ void operands_visible() {
  if constexpr (Tr::kWgmma) fence_async_shared();
  __syncthreads();
}

// sc (holding bias / scale) += Q K^T for this warp's rows.
template <typename Tr, typename T>
__device__ __forceinline__ void scores_gemm(float (&sc)[Tr::MT][Tr::NTS][4], const T* sQ,
                                            const T* sK, int warp_row0, int lane) {
  constexpr int D = Tr::D, BM = Tr::BM, BN = Tr::BN, MT = Tr::MT;
  if constexpr (Tr::kWgmma) {
    float(&acc)[BN / 2] = flat(sc);
    const uint64_t dq = gmma_desc(smem_u32(sQ), 0);
    const uint64_t dk = gmma_desc(smem_u32(sK), 0);
    wgmma_group(
        [&] {
          wgmma_issue<0, 0, D / 16>(
              acc, dq, dk, [](int ks) { return kmajor_step(ks, BM); },
              [](int ks) { return kmajor_step(ks, BN); }, T());
        },
        acc);
  } else {
    using E = Elem<T>;
    const FragAddr<BM, D> fq(sQ, warp_row0 + (lane & 7) + ((lane >> 3) & 1) * 8,
                             (lane >> 4) * 8);
    const FragAddr<BN, D> fk(sK, (lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], fq(mt * 16, ks * 16));
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bk[4];
        ldsm_x4(bk, fk(np * 16, ks * 16));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          E::mma(sc[mt][2 * np], a[mt], bk[0], bk[1]);
          E::mma(sc[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
  }
}

// o += P V, P = the probabilities in sc, rounded to T.
template <typename Tr, typename T>
__device__ __forceinline__ void output_gemm(float (&o)[Tr::MT][Tr::NTO][4],
                                            const float (&sc)[Tr::MT][Tr::NTS][4], const T* sV,
                                            int lane) {
  using E = Elem<T>;
  constexpr int D = Tr::D, BN = Tr::BN, MT = Tr::MT;
  uint32_t a[BN / 16][MT][4];
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[kk][mt][0] = E::pack(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
      a[kk][mt][1] = E::pack(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
      a[kk][mt][2] = E::pack(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
      a[kk][mt][3] = E::pack(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
    }
  if constexpr (Tr::kWgmma) {
    // V is MN-major here (its rows run along the reduction dim).
    constexpr int kC = Tr::kChunkO, kChunks = D / kC;
    float(&acc)[kChunks][kC / 2] = reinterpret_cast<float(&)[kChunks][kC / 2]>(o);
    const uint64_t dv = gmma_desc(smem_u32(sV), BN * 128);
    wgmma_group(
        [&] {
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
              wgmma_rs<1>(acc[c], a[kk][0],
                          gmma_advance(dv, mnmajor_step(kk) + c * (kC / 64) * BN * 128), true,
                          T());
        },
        flat(o));
  } else {
    const FragAddr<BN, D> fv(sV, (lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        ldsm_x4_t(bv, fv(kk * 16, dp * 16));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          E::mma(o[mt][2 * dp], a[kk][mt], bv[0], bv[1]);
          E::mma(o[mt][2 * dp + 1], a[kk][mt], bv[2], bv[3]);
        }
      }
    }
  }
}

}  // namespace detail

// kIndex: the index masks compiled (IndexKind, index_masks.cuh); kTable: a window table
// (AttentionShape::head_windows); kThreshold: softmax-threshold skipping.
// Kernels of their own (PickRules in launch_template.cuh), so that the others compile none of
// their code.
template <typename Tr, typename T, int kIndex, bool kTable, bool kThreshold = false>
__global__ void __launch_bounds__(Tr::kNT) fwd_kernel(const __grid_constant__ FwdParams p) {
  using namespace detail;
  static_assert(!kThreshold || (Tr::BM == kSkipBlockQ && Tr::BN == kSkipBlockK && Tr::MT == 1),
                "a threshold tile is one block of the rule's grid, its warps' rows one MMA tile");
  using E = Elem<T>;
  constexpr int D = Tr::D, BM = Tr::BM, BN = Tr::BN, NT = Tr::kNT, MT = Tr::MT;
  constexpr int NTS = Tr::NTS, NTO = Tr::NTO;
  constexpr bool kIndexed = kIndex != kNoIndex;
  constexpr bool kGated = kIndex == kGatedForms;
  using TileQ = SwizzledTile<BM, D>;
  using TileKV = SwizzledTile<BN, D>;

  static_assert(BN * 4 <= kSegmentSmem, "a key block's ids (and delta) fit the prefix");
  extern __shared__ __align__(128) uint8_t smem_base[];
  uint8_t* smem = smem_base + IndexPrefixSmem(kIndex);
  int32_t* sKeyIds = reinterpret_cast<int32_t*>(smem_base);  // segment ids: block n's kv ids
  float* sKeyDelta = reinterpret_cast<float*>(smem_base + kSegmentSmem);  // the gate's, block n's
  T* sQ = reinterpret_cast<T*>(smem + Tr::kOffQ);
  T* sK = reinterpret_cast<T*>(smem + Tr::kOffK);
  T* sV = reinterpret_cast<T*>(smem + Tr::kOffV);
  T* sBias = reinterpret_cast<T*>(smem + Tr::kOffBias);
  uint8_t* sMask = smem + Tr::kOffMask;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const AttentionShape& s = p.s;

  const int H = static_cast<int>(s.num_heads);
  const int64_t bid = blockIdx.x;
  const int split = static_cast<int>(bid % p.num_splits);
  const int64_t tile = bid / p.num_splits;
  const int rank = static_cast<int>(tile % p.m_blocks);
  const int64_t bh = tile / p.m_blocks;
  const int m_block = p.block_order != nullptr ? p.block_order[bh * p.m_blocks + rank]
                                               : p.m_blocks - 1 - rank;
  const int h = static_cast<int>(bh % H);
  const int64_t b = bh / H;
  const int hk = h / static_cast<int>(s.num_heads / s.num_kv_heads);
  const SeqLens L = seq_lens(s, p.q_lens, p.kv_lens, b);
  const PositionRule rule = position_rule_of<kTable>(p, hk);
  const Band& band = rule.band;
  const int Lq = static_cast<int>(s.seqlen_q);
  const int m0 = m_block * BM;

  const int64_t q_rs = s.q_row_stride();
  const int64_t kv_rs = s.kv_row_stride();
  const T* qg = static_cast<const T*>(p.q) + s.q_offset(b, h) + m0 * q_rs;
  const T* kg = static_cast<const T*>(p.k) + s.kv_offset(b, hk);
  const T* vg = static_cast<const T*>(p.v) + s.kv_offset(b, hk);

  const bool has_mask = p.mask != nullptr;
  const bool has_bias = p.bias != nullptr;
  const bool has_segments = has_segment_ids<kIndex>(p);
  const bool mask_one_row = s.mask.row_stride == 0;
  const bool bias_one_row = s.bias.row_stride == 0;
  const uint8_t* mg = has_mask ? p.mask + s.mask.offset(s.batch, b, h) + m0 * s.mask.row_stride
                               : nullptr;
  const T* bg = has_bias ? static_cast<const T*>(p.bias) + s.bias.offset(s.batch, b, h) +
                               m0 * s.bias.row_stride
                         : nullptr;
  const int valid_q = L.q_len - m0;  // rows of this block that exist for this batch

  // Key-block range from lengths and the position rule alone (with a sink, its blocks too and
  // the gap between them stepped over).
  const KeyBlocks visible = visible_key_blocks<BM, BN, kTable>(L, rule, m0);
  int n_lo = visible.all.lo, n_hi = visible.all.hi;
  if (p.num_splits > 1) {
    n_lo = max(n_lo, split * p.split_blocks);
    n_hi = min(n_hi, (split + 1) * p.split_blocks);
  }

  auto load_mask = [&](int n) {
    load_operand_tile<BM, BN, Tr::kMaskPitch, NT, Tr::kSpareRegisters>(
        sMask, mg + static_cast<int64_t>(n) * BN * s.mask.col_stride, s.mask.row_stride,
        s.mask.col_stride, valid_q, L.kv_len - n * BN, p.mask_vec, mask_one_row, tid);
  };
  auto load_bias = [&](int n) {
    load_operand_tile<BM, BN, Tr::kBiasPitch, NT, Tr::kSpareRegisters>(
        sBias, bg + static_cast<int64_t>(n) * BN * s.bias.col_stride, s.bias.row_stride,
        s.bias.col_stride, valid_q, L.kv_len - n * BN, p.bias_vec, bias_one_row, tid);
  };
  auto load_kv = [&](T* dst, const T* src, int n) {
    load_tile_async<BN, D, NT>(dst, src + static_cast<int64_t>(n) * BN * kv_rs, kv_rs,
                               L.kv_len - n * BN, tid);
  };
  auto gate = [&] { return GateView(p, b, h); };  // made where read (registers)
  // K, bias and (unless all true) mask of block n, its kv ids where the ids differ and the
  // gate's delta: one commit group.
  auto load_block = [&](int n, int flags) {
    load_kv(sK, kg, n);
    if (has_bias) load_bias(n);
    if (!(flags & kTileAll)) load_mask(n);
    if constexpr (kIndexed) {
      if (has_segments && (flags & kTileIndexed)) {
        load_ids_async<BN, NT>(sKeyIds, kv_segment_row(p, b) + n * BN, L.kv_len - n * BN, tid);
      }
    }
    if constexpr (kGated) {
      gate().template load_keys_async<BN, NT>(sKeyDelta, n * BN, L.kv_len - n * BN, tid);
    }
    cp_async_commit();
  };
  const MaskMapView map(p.mask_map, s, b, h);
  const FormEntries form_entries(p.forms, s, b, h);  // read by kIndexed kernels only
  auto make_walk = [&] {
    if constexpr (kIndexed && kThreshold) {
      return indexed_key_block_walk_up<BM, BN>(map, has_mask, m0, n_hi,
                                               IndexMasks<kIndex>(p, b, form_entries));
    } else if constexpr (kIndexed) {
      return indexed_key_block_walk<BM, BN>(map, has_mask, m0, n_lo,
                                            IndexMasks<kIndex>(p, b, form_entries));
    } else if constexpr (kThreshold) {
      return TileWalk<1, KeyTileFlags<BM, BN>>(has_mask, {map, m0}, n_hi);
    } else {
      return key_block_walk<BM, BN>(map, has_mask, m0, n_lo);
    }
  };
  auto walk = make_walk();
  auto walk_next = [&](int n, int* flags) {
    if constexpr (Tr::kSpareRegisters) {
      return walk.next(n, flags);
    } else {
      return make_walk().next(n, flags);
    }
  };
  auto next_visible = [&](int n, int* flags) {
    if constexpr (kTable && kThreshold) {
      return visible.gap.next_up(n, flags, walk_next);
    } else if constexpr (kTable) {
      return visible.gap.next(n, flags, walk_next);
    } else {
      return walk_next(n, flags);
    }
  };
  // The gate (kGatedForms kernels): alpha of this thread's rows; the walk passes over the grid
  // blocks its threshold drops (the tiles nest in the grid's blocks).
  static_assert(kGateBlockQ % BM == 0 && kGateBlockK % BN == 0, "tiles nest in the gate grid");
  float row_alpha[kGated ? 2 * MT : 1];
  if constexpr (kGated) {
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
      row_alpha[r] = gate().row(m0 + warp * Tr::kRowsPerWarp + (r >> 1) * 16 + g + (r & 1) * 8);
    }
  }
  auto gate_filter = [&] {  // the threshold's verdicts on this row block's grid key blocks
    if constexpr (kGated) {
      return GateFilter<true>(gate(), m0 / static_cast<int>(kGateBlockQ));
    } else {
      return 0;
    }
  }();
  auto next_block = [&](int n, int* flags) {
    int next = next_visible(n, flags);
    if constexpr (kGated && !kThreshold) {  // past the grid blocks the gate threshold drops
      next = gate_filter.template next_kept<BN>(next, n_lo - 1, next_visible, flags);
    }
    return next;
  };

  // ---- prologue -------------------------------------------------------------------------
  load_tile_async<BM, D, NT>(sQ, qg, q_rs, valid_q, tid);
  cp_async_commit();
  int flags;  // of block n
  // The walk's direction: down the key blocks, or up in the threshold kernels.
  constexpr int kStep = kThreshold ? 1 : -1;
  auto in_walk = [&](int t) { return kThreshold ? t < n_hi : t >= n_lo; };
  int n = next_block(kThreshold ? n_lo : n_hi - 1, &flags);
  if (in_walk(n)) load_block(n, flags);

  float o[MT][NTO][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NTO; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][t][e] = 0.f;
  float row_m[2 * MT], row_l[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {
    row_m[r] = -INFINITY;
    row_l[r] = 0.f;
  }
  const int warp_row0 = warp * Tr::kRowsPerWarp;
  // With segment ids: the ids of this thread's rows (rows past the length: hidden by the bounds
  // test)
  int row_ids[kIndexed ? 2 * MT : 1];
  if (has_segments) {
    const int32_t* ids = q_segment_row(p, b);
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
      const int i = m0 + warp_row0 + (r >> 1) * 16 + g + (r & 1) * 8;
      row_ids[r] = i < L.q_len ? __ldg(ids + i) : 0;
    }
  }

  // Softmax-threshold skipping: whether block n is folded in (kept, or without a visible score:
  // nothing to fold, not recorded), by a vote of the CTA's threads; a dropped block's byte of the
  // drop map is set.
  float log2_ratio[2] = {};
  if constexpr (kThreshold) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      log2_ratio[half] = threshold_log2_ratio(static_cast<float>(s.softmax_threshold),
                                              m0 + warp_row0 + g + 8 * half, L, rule);
    }
  }
  auto threshold_folds = [&](float (&scores)[MT][NTS][4], const float (&m)[2 * MT],
                             const float (&l)[2 * MT], int block) {
    if constexpr (kThreshold) {
      const RowVerdict v = row_verdict(flat(scores), m, l, log2_ratio, p.softmax_mul);
      if (cta_any(v.keep)) return true;
      if (cta_any(v.seen) && tid == 0) {
        p.drop_map[s.drop_map_offset(b, h) + m_block * s.skip_cols() + block] = 1;
      }
      return false;
    } else {
      return true;
    }
  };

  // ---- main loop over visible, non-empty key blocks ----------------------------------------
  while (in_walk(n)) {
    const int n0 = n * BN;
    cp_async_wait<0>();
    operands_visible<Tr>();  // K, bias, mask of block n (and Q)
    load_kv(sV, vg, n);
    cp_async_commit();

    // The forms' element test runs before the GEMM: its loads then take the registers that S's
    // accumulators take later (after it, 200+ bytes of spills at D = 128).
    const bool forms_test = has_mask_forms<kIndex>(p) && (flags & kTileIndexed);
    uint32_t form_hidden[kIndexed ? (MT * NTS * 4 + 31) / 32 : 1] = {};
    if (forms_test) {
      MaskFormsView(p.forms, form_entries).each_form([&](auto sees) {
        for_each_element<MT, NTS>([&](int mt, int t, int e) {
          const int bit = (mt * NTS + t) * 4 + e;
          const bool in = sees(m0 + warp_row0 + mt * 16 + g + (e >> 1) * 8,
                               n0 + t * 8 + 2 * tq + (e & 1));
          form_hidden[bit / 32] |= static_cast<uint32_t>(!in) << (bit % 32);
        });
      });
    }

    // S = bias / scale + Q K^T (each optional feature is tested once around its element loop:
    // a branch, not a predicated instruction per element)
    float sc[MT][NTS][4];
    if (has_bias) {
      for_each_pair<MT, NTS>([&](int mt, int t, int half) {
        const int r = bias_one_row ? 0 : warp_row0 + mt * 16 + g + half * 8;
        const float2 bv = E::unpack(
            *reinterpret_cast<const uint32_t*>(sBias + r * Tr::kBiasPitch + t * 8 + 2 * tq));
        sc[mt][t][2 * half] = bv.x * p.bias_mul;
        sc[mt][t][2 * half + 1] = bv.y * p.bias_mul;
      });
    } else {
      for_each_element<MT, NTS>([&](int mt, int t, int e) { sc[mt][t][e] = 0.f; });
    }
    scores_gemm<Tr>(sc, sQ, sK, warp_row0, lane);
    if constexpr (kGated) {  // + logsigmoid(alpha_i delta_j) / scale, with the bias
      for_each_pair<MT, NTS>([&](int mt, int t, int half) {
        const float2 d = *reinterpret_cast<const float2*>(sKeyDelta + t * 8 + 2 * tq);
        const float a = row_alpha[2 * mt + half];
        sc[mt][t][2 * half] += log_sigmoid(a * d.x) * p.bias_mul;
        sc[mt][t][2 * half + 1] += log_sigmoid(a * d.y) * p.bias_mul;
      });
    }

    // softcap, then visibility
    if (p.softcap > 0.f) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NTS; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sc[mt][t][e] = p.softcap * accurate_tanh(sc[mt][t][e] * p.softcap_in);
    }
    const bool need_bounds =
        (m0 + BM > L.q_len) || (n0 + BN > L.kv_len) ||
        (static_cast<int64_t>(n0) - (m0 + BM - 1) < band.dmin) ||
        (static_cast<int64_t>(n0) + BN - 1 - m0 > band.dmax);
    if (!(flags & kTileAll)) {
      for_each_pair<MT, NTS>([&](int mt, int t, int half) {
        const int r = mask_one_row ? 0 : warp_row0 + mt * 16 + g + half * 8;
        const uint16_t mm =
            *reinterpret_cast<const uint16_t*>(sMask + r * Tr::kMaskPitch + t * 8 + 2 * tq);
        if (!(mm & 0xff)) sc[mt][t][2 * half] = -INFINITY;
        if (!(mm >> 8)) sc[mt][t][2 * half + 1] = -INFINITY;
      });
    }
    if (need_bounds) {
      for_each_element<MT, NTS>([&](int mt, int t, int e) {
        const int i = m0 + warp_row0 + mt * 16 + g + (e >> 1) * 8;
        const int j = n0 + t * 8 + 2 * tq + (e & 1);
        bool in;
        if constexpr (kTable) {
          in = i < L.q_len && j < L.kv_len && rule.sees(i, j);
        } else {
          in = i < L.q_len && j < L.kv_len && j - i >= band.dmin && j - i <= band.dmax;
        }
        if (!in) sc[mt][t][e] = -INFINITY;
      });
    }
    if constexpr (kIndexed) {
      if (has_segments && (flags & kTileIndexed)) {
        for_each_pair<MT, NTS>([&](int mt, int t, int half) {
          const int2 key = *reinterpret_cast<const int2*>(sKeyIds + t * 8 + 2 * tq);
          const int row = row_ids[2 * mt + half];
          if (key.x != row) sc[mt][t][2 * half] = -INFINITY;
          if (key.y != row) sc[mt][t][2 * half + 1] = -INFINITY;
        });
      }
      if (forms_test) {
        for_each_element<MT, NTS>([&](int mt, int t, int e) {
          const int bit = (mt * NTS + t) * 4 + e;
          if (form_hidden[bit / 32] >> (bit % 32) & 1u) sc[mt][t][e] = -INFINITY;
        });
      }
    }

    int next_flags;
    const int next = next_block(n + kStep, &next_flags);
    cp_async_wait<0>();
    operands_visible<Tr>();  // V(n); K, bias and mask buffers free
    if (in_walk(next)) load_block(next, next_flags);

    if (!kThreshold || threshold_folds(sc, row_m, row_l, n)) {
      online_softmax<MT, NTS, NTO>(sc, row_m, row_l, o, p.softmax_mul);

      // O += P V
      output_gemm<Tr>(o, sc, sV, lane);
    }

    flags = next_flags;
    n = next;
  }

  // ---- epilogue ---------------------------------------------------------------------------
  cp_async_wait<0>();
  __syncthreads();  // all reads of sQ done, no copy in flight
  float inv_l[2 * MT], lse[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {
    float l = row_l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv_l[r] = l > 0.f ? 1.f / l : 0.f;
    lse[r] = l > 0.f ? row_m[r] * p.lse_mul + logf(l) : -INFINITY;
  }
  // fp32 results (a split's partial output, or a float32 out) go straight from registers; a
  // T out goes through shared memory for 16-byte stores.
  const bool direct = p.num_splits > 1 || p.out_f32;
  float* lse_dst = p.lse + s.lse_offset(b, h) + m0;
  float* o_dst = static_cast<float*>(p.out) + s.q_offset(b, h) + m0 * q_rs;
  int64_t o_row_stride = q_rs;
  if (p.num_splits > 1) {
    const int64_t rows = (split * s.batch_count() * H + bh) * Lq + m0;
    lse_dst = p.lse_partial + rows;
    o_dst = p.o_partial + rows * D;
    o_row_stride = D;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * mt + half;
      const int rl = warp_row0 + mt * 16 + g + half * 8;
      if (m0 + rl >= Lq) continue;
      if (tq == 0) lse_dst[rl] = lse[r];
#pragma unroll
      for (int t = 0; t < NTO; ++t) {
        const float x0 = o[mt][t][2 * half] * inv_l[r], x1 = o[mt][t][2 * half + 1] * inv_l[r];
        if (direct) {
          *reinterpret_cast<float2*>(o_dst + rl * o_row_stride + t * 8 + 2 * tq) =
              make_float2(x0, x1);
        } else {
          *reinterpret_cast<uint32_t*>(sQ + TileQ::off(rl, t * 8 + 2 * tq)) = E::pack(x0, x1);
        }
      }
    }
  }
  if (direct) return;
  __syncthreads();
  T* og = static_cast<T*>(p.out) + s.q_offset(b, h) + m0 * q_rs;
  store_tile<BM, D, NT>(og, sQ, q_rs, Lq - m0, tid);
}

}  // namespace dmattn::cuda
