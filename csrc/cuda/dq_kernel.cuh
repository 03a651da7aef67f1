// Deterministic dq: one CTA per (query block, head, batch) walks its visible key blocks and
// accumulates dQ = dS K in registers (no atomics), so dq is bitwise reproducible. Used when
// shape.deterministic; the main backward kernel then skips its dQ phase. Index masks
// (kIndex), window tables (kTable) and the gate (gate.cuh) act as in the forward
// (index_masks.cuh, fwd_kernel.cuh).
//   S = bias/scale + Q K^T, dP = dO V^T, P = exp(S - lse), dS = P (dP - D), dQ += dS K.
// On sm_90a (D = 64, 128) the CTA's four warps are one warpgroup and the GEMMs are wgmmas: S and
// dP from shared memory, dQ += dS K with dS from registers (a warp's accumulator rows are its
// mma.sync rows, so the element code is shared).
#pragma once

#include <cmath>

#include "cuda/block_map.cuh"
#include "cuda/drop_map.cuh"
#include "cuda/gate.cuh"
#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/index_masks.cuh"
#include "cuda/sm90.cuh"

namespace dmattn::cuda {

struct DqParams {
  BwdParams p;
  void* dq;
  int m_blocks;
};

template <int D_, int BM_, int BN_, int NW_>
struct DqTraits {
  static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
  static constexpr int kNT = NW * 32;
  static_assert(BM == NW * 16, "one 16-row MMA tile per warp");
  static constexpr int NTS = BN / 8;
  static constexpr int NTO = D / 8;
  static constexpr int kBiasPitch = BN + 8;
  static constexpr int kMaskPitch = BN + 16;
  static constexpr int kOffQ = 0;
  static constexpr int kOffdO = kOffQ + BM * D * 2;
  static constexpr int kOffK = kOffdO + BM * D * 2;
  static constexpr int kOffV = kOffK + BN * D * 2;
  static constexpr int kOffBias = kOffV + BN * D * 2;
  static constexpr int kOffMask = kOffBias + BM * kBiasPitch * 2;
  static constexpr int kMaskTile = BM * kMaskPitch;
  static constexpr int kSmem = kOffMask + kMaskTile;
#if defined(DMATTN_WGMMA)
  static constexpr bool kWgmma = NW == 4 && BM == 64 && BN == 64 && (D == 64 || D == 128);
#else
  static constexpr bool kWgmma = false;
#endif
  static_assert(!kWgmma || (kOffdO % 1024 == 0 && kOffK % 1024 == 0 && kOffV % 1024 == 0),
                "wgmma operands start on 1024-byte boundaries");
};

template <typename Tr, typename T, int kIndex, bool kTable>
__global__ void __launch_bounds__(Tr::kNT) dq_kernel(const __grid_constant__ DqParams dqp) {
  using namespace detail;
  using E = Elem<T>;
  constexpr int D = Tr::D, BM = Tr::BM, BN = Tr::BN, NT = Tr::kNT;
  constexpr int NTS = Tr::NTS, NTO = Tr::NTO;
  constexpr bool kIndexed = kIndex != kNoIndex;
  constexpr bool kGated = kIndex == kGatedForms;
  using TileQ = SwizzledTile<BM, D>;
  using TileKV = SwizzledTile<BN, D>;
  const BwdParams& p = dqp.p;

  static_assert(BN * 4 <= kSegmentSmem, "a key block's ids (and delta) fit the prefix");
  extern __shared__ __align__(128) uint8_t smem_base[];
  uint8_t* smem = smem_base + IndexPrefixSmem(kIndex);
  int32_t* sKeyIds = reinterpret_cast<int32_t*>(smem_base);  // segment ids: block n's kv ids
  float* sKeyDelta = reinterpret_cast<float*>(smem_base + kSegmentSmem);  // the gate's, block n's
  T* sQ = reinterpret_cast<T*>(smem + Tr::kOffQ);
  T* sdO = reinterpret_cast<T*>(smem + Tr::kOffdO);
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
  const int m_block = dqp.m_blocks - 1 - static_cast<int>(bid % dqp.m_blocks);
  const int64_t bh = bid / dqp.m_blocks;
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
  const T* dog = static_cast<const T*>(p.dout) + s.q_offset(b, h) + m0 * q_rs;
  const T* kg = static_cast<const T*>(p.k) + s.kv_offset(b, hk);
  const T* vg = static_cast<const T*>(p.v) + s.kv_offset(b, hk);

  const bool has_mask = p.mask != nullptr;
  const bool has_segments = has_segment_ids<kIndex>(p);
  const bool has_bias = p.bias != nullptr;
  const bool mask_one_row = s.mask.row_stride == 0;
  const bool bias_one_row = s.bias.row_stride == 0;
  const uint8_t* mg = has_mask ? p.mask + s.mask.offset(s.batch, b, h) + m0 * s.mask.row_stride
                               : nullptr;
  const T* bg = has_bias ? static_cast<const T*>(p.bias) + s.bias.offset(s.batch, b, h) +
                               m0 * s.bias.row_stride
                         : nullptr;
  const int valid_q = L.q_len - m0;

  const KeyBlocks visible = visible_key_blocks<BM, BN, kTable>(L, rule, m0);
  const int n_lo = visible.all.lo, n_hi = visible.all.hi;

  auto load_mask = [&](int n) {
    load_operand_tile<BM, BN, Tr::kMaskPitch, NT>(
        sMask, mg + static_cast<int64_t>(n) * BN * s.mask.col_stride, s.mask.row_stride,
        s.mask.col_stride, valid_q, L.kv_len - n * BN, p.mask_vec, mask_one_row, tid);
  };
  auto load_bias = [&](int n) {
    load_operand_tile<BM, BN, Tr::kBiasPitch, NT>(
        sBias, bg + static_cast<int64_t>(n) * BN * s.bias.col_stride, s.bias.row_stride,
        s.bias.col_stride, valid_q, L.kv_len - n * BN, p.bias_vec, bias_one_row, tid);
  };
  auto load_kv = [&](T* dst, const T* src, int n) {
    load_tile_async<BN, D, NT>(dst, src + static_cast<int64_t>(n) * BN * kv_rs, kv_rs,
                               L.kv_len - n * BN, tid);
  };
  auto gate = [&] { return GateView(p, b, h); };  // made where read (registers)
  // V, bias, mask (unless all true), kv ids (where they differ) and the gate's delta of block n.
  auto load_operands = [&](int n, int flags) {
    load_kv(sV, vg, n);
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
  };

  load_tile_async<BM, D, NT>(sQ, qg, q_rs, valid_q, tid);
  load_tile_async<BM, D, NT>(sdO, dog, q_rs, valid_q, tid);
  cp_async_commit();

  // Per-row lse (log2 units, +inf for rows with no visible key) and softmax_d.
  const int row0 = warp * 16 + g;
  float lse2[2], dsum[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = m0 + row0 + half * 8;
    float l = -INFINITY, d = 0.f;
    if (i < L.q_len) {
      l = p.lse[s.lse_offset(b, h) + i];
      d = p.softmax_d[s.lse_offset(b, h) + i];
    }
    lse2[half] = l == -INFINITY ? INFINITY : l * kLog2e;
    dsum[half] = d;
  }
  int row_ids[2] = {0, 0};  // segment ids (rows past the length: hidden by the bounds test)
  if (has_segments) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = m0 + row0 + half * 8;
      if (i < L.q_len) row_ids[half] = __ldg(q_segment_row(p, b) + i);
    }
  }

  // A fresh walk at every step: one kept across steps takes registers this 255-register kernel
  // lacks (H200 harness, deterministic dense D=128 L4k backward: 8.32 ms kept, 8.26 fresh).
  const MaskMapView map(p.mask_map, s, b, h);
  const FormEntries form_entries(p.forms, s, b, h);  // read by kIndexed kernels only
  auto walk_next = [&](int n, int* flags) {
    if constexpr (kIndexed) {
      return indexed_key_block_walk<BM, BN>(map, has_mask, m0, n_lo,
                                            IndexMasks<kIndex>(p, b, form_entries))
          .next(n, flags);
    } else {
      return key_block_walk<BM, BN>(map, has_mask, m0, n_lo).next(n, flags);
    }
  };
  auto next_visible = [&](int n, int* flags) {
    if constexpr (kTable) {
      return visible.gap.next(n, flags, walk_next);
    } else {
      return walk_next(n, flags);
    }
  };
  // The gate (kGatedForms kernels): alpha of this thread's rows; the walk passes over the grid
  // blocks its threshold drops (the tiles nest in the grid's blocks).
  static_assert(kGateBlockQ % BM == 0 && kGateBlockK % BN == 0, "tiles nest in the gate grid");
  float row_alpha[2] = {0.f, 0.f};
  if constexpr (kGated) {
#pragma unroll
    for (int half = 0; half < 2; ++half) row_alpha[half] = gate().row(m0 + row0 + half * 8);
  }
  auto gate_filter = [&] {  // the threshold's verdicts on this row block's grid key blocks
    if constexpr (kGated) {
      return GateFilter<true>(gate(), m0 / static_cast<int>(kGateBlockQ));
    } else {
      return 0;
    }
  }();
  const DropFilter<true> drops(p.drop_map, s, b, h, m0 / static_cast<int>(kSkipBlockQ));
  auto next_block = [&](int n, int* flags) {
    int next = next_visible(n, flags);
    if constexpr (kGated) {  // past the grid blocks the gate threshold drops
      next = gate_filter.template next_kept<BN>(next, n_lo - 1, next_visible, flags);
    }
    // past the blocks softmax-threshold skipping dropped in the forward
    return drops.next_kept<BN>(next, n_lo - 1, next_visible, flags);
  };
  int flags;  // of block n
  int n = next_block(n_hi - 1, &flags);
  if (n >= n_lo) {
    load_kv(sK, kg, n);
    load_operands(n, flags);
    cp_async_commit();
  }

  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;
  const FragAddr<BM, D> fq(sQ, warp * 16 + a_row, a_col), fo(sdO, warp * 16 + a_row, a_col);
  const FragAddr<BN, D> fk(sK, b_row, b_col), fv(sV, b_row, b_col);
  const FragAddr<BN, D> fkT(sK, a_row, a_col);

  float acc[NTO][4];
#pragma unroll
  for (int t = 0; t < NTO; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;

  while (n >= n_lo) {
    const int n0 = n * BN;
    cp_async_wait<0>();
    if constexpr (Tr::kWgmma) fence_async_shared();
    __syncthreads();  // K, V, bias, mask of block n visible

    // The forms' element test before the GEMMs, as in the forward: bit (half NTS + t) 2 + e.
    static_assert(4 * NTS <= 32, "a bit per element of a thread");
    uint32_t form_hidden = 0;
    if (has_mask_forms<kIndex>(p) && (flags & kTileIndexed)) {
      MaskFormsView(p.forms, form_entries).each_form([&](auto sees) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int t = 0; t < NTS; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const bool in = sees(m0 + row0 + half * 8, n0 + t * 8 + 2 * tq + e);
              form_hidden |= static_cast<uint32_t>(!in) << ((half * NTS + t) * 2 + e);
            }
      });
    }

    float sc[NTS][4], dp[NTS][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rr = bias_one_row ? 0 : row0 + half * 8;
#pragma unroll
      for (int t = 0; t < NTS; ++t) {
        float2 bv = make_float2(0.f, 0.f);
        if (has_bias) {
          bv = E::unpack(
              *reinterpret_cast<const uint32_t*>(sBias + rr * Tr::kBiasPitch + t * 8 + 2 * tq));
          bv.x *= p.bias_mul;
          bv.y *= p.bias_mul;
        }
        sc[t][2 * half] = bv.x;
        sc[t][2 * half + 1] = bv.y;
        dp[t][2 * half] = 0.f;
        dp[t][2 * half + 1] = 0.f;
      }
    }
    if constexpr (Tr::kWgmma) {
      auto q_step = [](int ks) { return kmajor_step(ks, BM); };
      auto k_step = [](int ks) { return kmajor_step(ks, BN); };
      wgmma_group(
          [&] {
            wgmma_issue<0, 0, D / 16>(flat(sc), gmma_desc(smem_u32(sQ), 0),
                                      gmma_desc(smem_u32(sK), 0), q_step, k_step, T());
            wgmma_issue<0, 0, D / 16>(flat(dp), gmma_desc(smem_u32(sdO), 0),
                                      gmma_desc(smem_u32(sV), 0), q_step, k_step, T());
          },
          flat(sc), flat(dp));
    } else {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t aq[4], ao[4];
        ldsm_x4(aq, fq(0, ks * 16));
        ldsm_x4(ao, fo(0, ks * 16));
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          uint32_t bk[4], bv[4];
          ldsm_x4(bk, fk(np * 16, ks * 16));
          ldsm_x4(bv, fv(np * 16, ks * 16));
          E::mma(sc[2 * np], aq, bk[0], bk[1]);
          E::mma(sc[2 * np + 1], aq, bk[2], bk[3]);
          E::mma(dp[2 * np], ao, bv[0], bv[1]);
          E::mma(dp[2 * np + 1], ao, bv[2], bv[3]);
        }
      }
    }

    if constexpr (kGated) {  // + logsigmoid(alpha_i delta_j) / scale, with the bias
#pragma unroll
      for (int t = 0; t < NTS; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float d = sKeyDelta[t * 8 + 2 * tq + e];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            sc[t][2 * half + e] += log_sigmoid(row_alpha[half] * d) * p.bias_mul;
          }
        }
    }
    const bool need_bounds =
        (m0 + BM > L.q_len) || (n0 + BN > L.kv_len) ||
        (static_cast<int64_t>(n0) - (m0 + BM - 1) < band.dmin) ||
        (static_cast<int64_t>(n0) + BN - 1 - m0 > band.dmax);
    const bool mask_apply = !(flags & kTileAll);
    const bool segments_apply = has_segments && (flags & kTileIndexed);
    const bool capped = p.softcap > 0.f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + half * 8;
      const int i = m0 + r;
      const int rr = mask_one_row ? 0 : r;
#pragma unroll
      for (int t = 0; t < NTS; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = t * 8 + 2 * tq + e;
          bool vis = true;
          if (mask_apply) vis = sMask[rr * Tr::kMaskPitch + c] != 0;
          if (need_bounds) {
            const int j = n0 + c;
            if constexpr (kTable) {
              vis = vis && i < L.q_len && j < L.kv_len && rule.sees(i, j);
            } else {
              const int dd = j - i;
              vis = vis && i < L.q_len && j < L.kv_len && dd >= band.dmin && dd <= band.dmax;
            }
          }
          if (segments_apply) vis = vis && sKeyIds[c] == row_ids[half];
          vis = vis && !(form_hidden >> ((half * NTS + t) * 2 + e) & 1u);
          float x = sc[t][2 * half + e];
          float tc = 0.f;
          if (capped) {
            tc = accurate_tanh(x * p.softcap_in);
            x = p.softcap * tc;
          }
          const float pv = vis ? fast_exp2(x * p.softmax_mul - lse2[half]) : 0.f;
          float ds = pv * (dp[t][2 * half + e] - dsum[half]);
          if (capped) ds *= (1.f - tc * tc);
          sc[t][2 * half + e] = ds;
        }
      }
    }

    int next_flags;
    const int next = next_block(n - 1, &next_flags);
    __syncthreads();  // V, bias, mask and ids free
    if (next >= n_lo) {
      load_operands(next, next_flags);
      cp_async_commit();
    }

    // dQ += dS K (dS as the A fragments of the k-steps: 16 keys each)
    uint32_t ds[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      ds[kk][0] = E::pack(sc[2 * kk][0], sc[2 * kk][1]);
      ds[kk][1] = E::pack(sc[2 * kk][2], sc[2 * kk][3]);
      ds[kk][2] = E::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      ds[kk][3] = E::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
    if constexpr (Tr::kWgmma) {  // K is MN-major here (D along its rows)
      wgmma_group(
          [&] {
            wgmma_issue_rs<1, BN / 16>(flat(acc), ds, gmma_desc(smem_u32(sK), BN * 128),
                                       [](int kk) { return mnmajor_step(kk); }, T());
          },
          flat(acc));
    } else {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
        for (int dq = 0; dq < D / 16; ++dq) {
          uint32_t bk[4];
          ldsm_x4_t(bk, fkT(kk * 16, dq * 16));
          E::mma(acc[2 * dq], ds[kk], bk[0], bk[1]);
          E::mma(acc[2 * dq + 1], ds[kk], bk[2], bk[3]);
        }
      }
    }
    __syncthreads();  // K free
    if (next >= n_lo) {
      load_kv(sK, kg, next);
      cp_async_commit();
    }
    flags = next_flags;
    n = next;
  }

  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + half * 8;
#pragma unroll
    for (int t = 0; t < NTO; ++t) {
      *reinterpret_cast<uint32_t*>(sQ + TileQ::off(r, t * 8 + 2 * tq)) =
          E::pack(acc[t][2 * half] * p.scale, acc[t][2 * half + 1] * p.scale);
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(dqp.dq) + s.q_offset(b, h) + m0 * q_rs;
  store_tile<BM, D, NT>(out, sQ, q_rs, Lq - m0, tid);
}

}  // namespace dmattn::cuda
