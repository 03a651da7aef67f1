// Backward kernels.
//
//   bwd_preprocess:  softmax_d = rowsum(dout * out) - dlse                  (one warp per row)
//   bwd_kernel:      one CTA per (key block, kv head, dk/dv slot class). K and V of the block
//                    stay in shared memory; the CTA walks every (batch, query head) pair that
//                    reads this kv slot (the GQA group and the batches dk/dv broadcast over) and
//                    every visible query block of each, so dK/dV accumulate in registers with no
//                    cross-CTA reduction. Per query block (all-false mask tiles skipped):
//                      phase A  S^T = K Q^T + bias^T/scale, dP^T = V dO^T, P, dS -> smem
//                      phase B  dV += P^T dO, dK += dS^T Q
//                      phase C  dQ += dS K   (fp32 atomics into the accumulator)
//   bwd_dq_convert:  dq = scale * accumulator in the output dtype
//   dbias_convert:   dbias = fp32 workspace in the output dtype (atomic dbias mode only)
//
// dbias: full-size bias -> dS tiles stored directly; bias broadcast over queries -> per-key sums
// kept in registers over the CTA's query blocks (and over the query heads that share the entry),
// stored once; shapes whose entries are shared between CTAs -> fp32 atomics into a workspace.
#pragma once

#include <cmath>

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda {

template <int D_, int BN_, int BM_, int NW_>
struct BwdTraits {
  static constexpr int D = D_, BN = BN_, BM = BM_, NW = NW_;
  static constexpr int kNT = NW * 32;
  // (Capping 8-warp CTAs at 128 registers for 2 CTAs/SM spills heavily; 1 is the bound.)
  static constexpr int kMinBlocks = 1;
  static constexpr int WK = BN / 16;  // key groups of 16
  static_assert(NW % WK == 0, "warps must tile the key block");
  static constexpr int WX = NW / WK;       // split of queries (phase A) and of D (phase B)
  static constexpr int QA = BM / WX;       // queries per warp in phase A
  static constexpr int NA = QA / 8;        // 8-col tiles in phase A
  static_assert(NA % 2 == 0, "phase A tiles come in pairs");
  static constexpr int DB = D / WX;        // head-dim columns per warp in phase B
  static_assert(DB % 16 == 0, "phase B columns");
  static constexpr int WMC = BM / 16;      // query groups in phase C
  static_assert(NW % WMC == 0, "warps must tile phase C");
  static constexpr int DC = D / (NW / WMC);  // head-dim columns per warp in phase C
  static constexpr int CH = DC <= 64 ? DC : (DC % 64 == 0 ? 64 : DC / 2);
  static_assert(DC % CH == 0 && CH % 16 == 0, "phase C chunks");

  static constexpr int kBiasPitch = BN + 8;
  static constexpr int kMaskPitch = BN + 16;
  static constexpr int kBiasBytes = BM * kBiasPitch * 2;
  static constexpr int kPBytes = BN * BM * 2;
  // For the largest head dims the bias tile shares memory with P (sm80 shared-memory limit).
  static constexpr bool kAliasBiasP = D > 192;

  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + BN * D * 2;
  static constexpr int kOffQ = kOffV + BN * D * 2;
  static constexpr int kOffdO = kOffQ + BM * D * 2;
  static constexpr int kOffdS = kOffdO + BM * D * 2;
  static constexpr int kOffP = kOffdS + kPBytes;
  static constexpr int kOffBias = kAliasBiasP ? kOffP : kOffP + kPBytes;
  static constexpr int kPBiasBytes = kAliasBiasP ? (kBiasBytes > kPBytes ? kBiasBytes : kPBytes)
                                                 : kPBytes + kBiasBytes;
  static constexpr int kOffMask = kOffP + kPBiasBytes;
  static constexpr int kMaskTile = BM * kMaskPitch;
  static constexpr int kOffLse = kOffMask + 2 * kMaskTile;
  static constexpr int kOffDsum = kOffLse + BM * 4;
  static constexpr int kOffDB = kOffDsum + BM * 4;
  static constexpr int kSmem = kOffDB + BN * 4;
};

namespace detail {

// Flat batch index of member `t` of dk/dv class `c`.
__device__ __forceinline__ int64_t batch_of(const BwdParams& p, int64_t c, int64_t t) {
  int64_t b = 0, mult = 1;
  for (int d = p.s.batch.rank - 1; d >= 0; --d) {
    const int64_t size = p.s.batch.sizes[d];
    int64_t idx;
    if (p.member_dim[d]) {
      idx = t % size;
      t /= size;
    } else {
      idx = c % size;
      c /= size;
    }
    b += idx * mult;
    mult *= size;
  }
  return b;
}

}  // namespace detail

template <typename Tr, typename T>
__global__ void __launch_bounds__(Tr::kNT, Tr::kMinBlocks) bwd_kernel(const __grid_constant__ BwdParams p) {
  using namespace detail;
  using E = Elem<T>;
  constexpr int D = Tr::D, BM = Tr::BM, BN = Tr::BN, NT = Tr::kNT;
  constexpr int WK = Tr::WK, NA = Tr::NA, DB = Tr::DB, DC = Tr::DC, CH = Tr::CH;
  using TileKV = SwizzledTile<BN, D>;
  using TileQ = SwizzledTile<BM, D>;
  using TileP = SwizzledTile<BN, BM>;

  extern __shared__ __align__(128) uint8_t smem[];
  T* sK = reinterpret_cast<T*>(smem + Tr::kOffK);
  T* sV = reinterpret_cast<T*>(smem + Tr::kOffV);
  T* sQ = reinterpret_cast<T*>(smem + Tr::kOffQ);
  T* sdO = reinterpret_cast<T*>(smem + Tr::kOffdO);
  T* sdS = reinterpret_cast<T*>(smem + Tr::kOffdS);
  T* sP = reinterpret_cast<T*>(smem + Tr::kOffP);
  T* sBias = reinterpret_cast<T*>(smem + Tr::kOffBias);
  uint8_t* sMask = smem + Tr::kOffMask;
  float* sLse = reinterpret_cast<float*>(smem + Tr::kOffLse);
  float* sDsum = reinterpret_cast<float*>(smem + Tr::kOffDsum);
  float* sDB = reinterpret_cast<float*>(smem + Tr::kOffDB);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const AttentionShape& s = p.s;

  const int Hk = static_cast<int>(s.num_kv_heads);
  const int G = static_cast<int>(s.num_heads / s.num_kv_heads);
  const int64_t bid = blockIdx.x;
  const int n_block = static_cast<int>(bid % p.n_blocks);
  const int hk = static_cast<int>((bid / p.n_blocks) % Hk);
  const int64_t cls = bid / p.n_blocks / Hk;
  const int n0 = n_block * BN;
  const int Lq = static_cast<int>(s.seqlen_q);
  const int Lk = static_cast<int>(s.seqlen_k);
  const Band band = make_band(s);

  const int64_t q_rs = s.q_row_stride();
  const int64_t kv_rs = s.kv_row_stride();
  const int64_t b_rep = batch_of(p, cls, 0);
  const T* kg = static_cast<const T*>(p.k) + s.kv_offset(b_rep, hk) + n0 * kv_rs;
  const T* vg = static_cast<const T*>(p.v) + s.kv_offset(b_rep, hk) + n0 * kv_rs;

  const bool has_mask = p.mask != nullptr;
  const bool has_bias = p.bias != nullptr;
  const bool mask_one_row = s.mask.row_stride == 0;
  const bool bias_one_row = s.bias.row_stride == 0;
  const int mask_rows = mask_one_row ? 1 : BM;
  const int dbias_mode = p.dbias_mode;
  const BroadcastOperand& dop = p.dbias_op;
  const bool db_rowsum = dbias_mode != kDbiasNone && dop.row_stride == 0;
  const bool db_colsum = dbias_mode != kDbiasNone && dop.row_stride != 0 && dop.col_stride == 0;

  // Warp roles.
  const int kgA = warp % WK;         // phase A / B key group
  const int xg = warp / WK;          // phase A query group / phase B head-dim group
  const int kr0 = kgA * 16;          // first key row (local) of this warp in phases A and B
  const int qc0 = Tr::WX == 1 ? 0 : xg * Tr::QA;  // first query (local) of this warp, phase A
  const int dc0 = Tr::WX == 1 ? 0 : xg * DB;       // first head-dim column in phase B
  const int mc = warp % Tr::WMC;                    // phase C query group
  const int dcc0 = (Tr::kNT / 32 == Tr::WMC) ? 0 : (warp / Tr::WMC) * DC;

  // ldmatrix addressing (see FragAddr): A operands (rows = M dim) use row lane part
  // (lane & 7) + ((lane >> 3) & 1) * 8 and column lane part (lane >> 4) * 8; non-transposed B
  // operands (rows = N dim) use (lane & 7) + (lane >> 4) * 8 and ((lane >> 3) & 1) * 8.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;
  const FragAddr<BN, D> fkA(sK, kr0 + a_row, a_col), fvA(sV, kr0 + a_row, a_col);
  const FragAddr<BM, D> fqA(sQ, qc0 + b_row, b_col), foA(sdO, qc0 + b_row, b_col);
  const FragAddr<BN, BM> fpB(sP, kr0 + a_row, a_col), fdsB(sdS, kr0 + a_row, a_col);
  const FragAddr<BM, D> foB(sdO, a_row, a_col, dc0), fqB(sQ, a_row, a_col, dc0);
  const FragAddr<BN, BM> fdsC(sdS, b_row, b_col, mc * 16);
  const FragAddr<BN, D> fkC(sK, a_row, a_col, dcc0);

  // K, V of this block (rows beyond the longest kv length are zero-filled; the per-pair lengths
  // are applied by visibility).
  load_tile_async<BN, D, NT>(sK, kg, kv_rs, Lk - n0, tid);
  load_tile_async<BN, D, NT>(sV, vg, kv_rs, Lk - n0, tid);
  cp_async_commit();
  if (tid < BN) sDB[tid] = 0.f;

  float dk[DB / 8][4], dv[DB / 8][4];
#pragma unroll
  for (int t = 0; t < DB / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dk[t][e] = 0.f;
      dv[t][e] = 0.f;
    }
  float db_acc[2] = {0.f, 0.f};  // per-key dbias sums (keys kr0 + g, kr0 + g + 8) of this thread
  bool db_dirty = false;

  const int64_t pairs = p.kv_members * G;
  for (int64_t pi = 0; pi < pairs; ++pi) {
    const int64_t b = batch_of(p, cls, pi / G);
    const int h = hk * G + static_cast<int>(pi % G);
    const SeqLens L = seq_lens(s, p.q_lens, p.kv_lens, b);
    const int64_t dbias_entry = dbias_mode != kDbiasNone ? dop.offset(s.batch, b, h) : 0;

    // Query blocks that see any key of this block.
    int m_first = 0, m_last = -1;
    if (n0 < L.kv_len && L.q_len > 0) {
      const int j_last = min(n0 + BN, L.kv_len) - 1;
      int64_t i_min = static_cast<int64_t>(n0) - band.dmax;  // j <= i + dmax
      int64_t i_max = static_cast<int64_t>(j_last) - band.dmin;  // j >= i + dmin
      i_min = i_min < 0 ? 0 : i_min;
      i_max = i_max > L.q_len - 1 ? L.q_len - 1 : i_max;
      if (i_max >= i_min) {
        m_first = static_cast<int>(i_min / BM);
        m_last = static_cast<int>(i_max / BM);
      }
    }

    const T* qg = static_cast<const T*>(p.q) + s.q_offset(b, h);
    const T* dog = static_cast<const T*>(p.dout) + s.q_offset(b, h);
    const float* lseg = p.lse + s.lse_offset(b, h);
    const float* dsg = p.softmax_d + s.lse_offset(b, h);
    const uint8_t* mg =
        has_mask ? p.mask + s.mask.offset(s.batch, b, h) + n0 * s.mask.col_stride : nullptr;
    const T* bg = has_bias ? static_cast<const T*>(p.bias) + s.bias.offset(s.batch, b, h) +
                                 n0 * s.bias.col_stride
                           : nullptr;

    auto load_mask = [&](int m, int buf) {
      load_operand_tile<BM, BN, Tr::kMaskPitch, NT>(
          sMask + buf * Tr::kMaskTile, mg + static_cast<int64_t>(m) * BM * s.mask.row_stride,
          s.mask.row_stride, s.mask.col_stride, L.q_len - m * BM, L.kv_len - n0, p.mask_vec,
          mask_one_row, tid);
    };
    auto load_step = [&](int m) {
      const int m0 = m * BM;
      load_tile_async<BM, D, NT>(sQ, qg + m0 * q_rs, q_rs, L.q_len - m0, tid);
      load_tile_async<BM, D, NT>(sdO, dog + m0 * q_rs, q_rs, L.q_len - m0, tid);
      for (int r = tid; r < BM; r += NT) {
        const bool ok = m0 + r < L.q_len;
        cp_async4(smem_u32(sLse + r), ok ? lseg + m0 + r : lseg, ok ? 4 : 0);
        cp_async4(smem_u32(sDsum + r), ok ? dsg + m0 + r : dsg, ok ? 4 : 0);
      }
      if (has_bias) {
        load_operand_tile<BM, BN, Tr::kBiasPitch, NT>(
            sBias, bg + static_cast<int64_t>(m0) * s.bias.row_stride, s.bias.row_stride,
            s.bias.col_stride, L.q_len - m0, L.kv_len - n0, p.bias_vec, bias_one_row, tid);
      }
      cp_async_commit();
    };

    // First active query block.
    int m = m_first;
    int cur = 0;
    if (has_mask) {
      while (m <= m_last) {
        load_mask(m, cur);
        cp_async_commit();
        cp_async_wait<0>();
        if (!p.mask_vec) __syncthreads();  // vector path: own copies only
        if (tile_any<BN, Tr::kMaskPitch, NT>(sMask + cur * Tr::kMaskTile, mask_rows, tid)) break;
        ++m;
      }
    }
    if (m <= m_last) load_step(m);

    while (m <= m_last) {
      const int m0 = m * BM;
      const bool cand = has_mask && (m + 1 <= m_last);
      if (cand) {
        load_mask(m + 1, cur ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // Q, dO, lse, D, bias of block m (and K, V) visible

      // ---------------- phase A: S^T, dP^T, P, dS --------------------------------------------
      float st[NA][4], dp[NA][4];
#pragma unroll
      for (int t = 0; t < NA; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float bv = 0.f;
          if (has_bias) {
            const int j = kr0 + g + (e >> 1) * 8;
            const int i = qc0 + t * 8 + 2 * tq + (e & 1);
            const int rr = bias_one_row ? 0 : i;
            bv = E::to_float(sBias[rr * Tr::kBiasPitch + j]) * p.bias_mul;
          }
          st[t][e] = bv;
          dp[t][e] = 0.f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t ak[4], av[4];
        ldsm_x4(ak, fkA(0, ks * 16));
        ldsm_x4(av, fvA(0, ks * 16));
#pragma unroll
        for (int np = 0; np < NA / 2; ++np) {
          uint32_t bq[4], bo[4];
          ldsm_x4(bq, fqA(np * 16, ks * 16));
          ldsm_x4(bo, foA(np * 16, ks * 16));
          E::mma(st[2 * np], ak, bq[0], bq[1]);
          E::mma(st[2 * np + 1], ak, bq[2], bq[3]);
          E::mma(dp[2 * np], av, bo[0], bo[1]);
          E::mma(dp[2 * np + 1], av, bo[2], bo[3]);
        }
      }

      const bool need_bounds =
          (m0 + BM > L.q_len) || (n0 + BN > L.kv_len) ||
          (static_cast<int64_t>(n0) - (m0 + BM - 1) < band.dmin) ||
          (static_cast<int64_t>(n0) + BN - 1 - m0 > band.dmax);
      const uint8_t* sm = sMask + cur * Tr::kMaskTile;
      const bool capped = p.softcap > 0.f;
#pragma unroll
      for (int t = 0; t < NA; ++t) {
        const int il0 = qc0 + t * 8 + 2 * tq;  // local query of elements e = 0, 2 (+1: e = 1, 3)
        const float2 lse2 = *reinterpret_cast<const float2*>(sLse + il0);
        const float2 ds2 = *reinterpret_cast<const float2*>(sDsum + il0);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int jl = kr0 + g + (e >> 1) * 8;
          const int il = il0 + (e & 1);
          const float lse = (e & 1) ? lse2.y : lse2.x;
          const float dsum = (e & 1) ? ds2.y : ds2.x;
          bool vis = true;
          if (has_mask) vis = sm[(mask_one_row ? 0 : il) * Tr::kMaskPitch + jl] != 0;
          if (need_bounds) {
            const int i = m0 + il, j = n0 + jl;
            const int dd = j - i;
            vis = vis && i < L.q_len && j < L.kv_len && dd >= band.dmin && dd <= band.dmax;
          }
          float x = st[t][e];
          float tc = 0.f;
          if (capped) {
            tc = accurate_tanh(x * p.softcap_in);
            x = p.softcap * tc;
          }
          // lse = -inf (no visible key) gives P = 0 without an inf - inf.
          const float lse_l2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
          const float pv = vis ? fast_exp2(x * p.softmax_mul - lse_l2) : 0.f;
          float ds = pv * (dp[t][e] - dsum);
          if (capped) ds *= (1.f - tc * tc);
          st[t][e] = pv;
          dp[t][e] = ds;
        }
      }

      // dbias contributions from registers
      if (dbias_mode != kDbiasNone) {
        if (db_rowsum) {
#pragma unroll
          for (int t = 0; t < NA; ++t) {
            db_acc[0] += dp[t][0] + dp[t][1];
            db_acc[1] += dp[t][2] + dp[t][3];
          }
          db_dirty = true;
        } else if (db_colsum) {
          // per-query sums over this warp's 16 keys, then fp32 atomics
#pragma unroll
          for (int t = 0; t < NA; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float v = dp[t][e] + dp[t][e + 2];
              v += __shfl_xor_sync(0xffffffffu, v, 4);
              v += __shfl_xor_sync(0xffffffffu, v, 8);
              v += __shfl_xor_sync(0xffffffffu, v, 16);
              const int i = m0 + qc0 + t * 8 + 2 * tq + e;
              if (g == 0 && i < L.q_len && v != 0.f) {
                atomicAdd(p.dbias_accum + dbias_entry + static_cast<int64_t>(i) * dop.row_stride,
                          v);
              }
            }
          }
        } else {
          T* dbg = static_cast<T*>(p.dbias);
#pragma unroll
          for (int t = 0; t < NA; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = m0 + qc0 + t * 8 + 2 * tq + (e & 1);
              const int j = n0 + kr0 + g + (e >> 1) * 8;
              if (i < L.q_len && j < L.kv_len) {
                const int64_t off = dbias_entry + static_cast<int64_t>(i) * dop.row_stride +
                                    static_cast<int64_t>(j) * dop.col_stride;
                if (dbias_mode == kDbiasDirect) {
                  dbg[off] = E::from_float(dp[t][e]);
                } else if (dp[t][e] != 0.f) {
                  atomicAdd(p.dbias_accum + off, dp[t][e]);
                }
              }
            }
          }
        }
      }

      if constexpr (Tr::kAliasBiasP) __syncthreads();  // bias tile (aliased by P) fully read
#pragma unroll
      for (int t = 0; t < NA; ++t) {
        const int c = qc0 + t * 8 + 2 * tq;
        *reinterpret_cast<uint32_t*>(sP + TileP::off(kr0 + g, c)) = E::pack(st[t][0], st[t][1]);
        *reinterpret_cast<uint32_t*>(sP + TileP::off(kr0 + g + 8, c)) =
            E::pack(st[t][2], st[t][3]);
        *reinterpret_cast<uint32_t*>(sdS + TileP::off(kr0 + g, c)) = E::pack(dp[t][0], dp[t][1]);
        *reinterpret_cast<uint32_t*>(sdS + TileP::off(kr0 + g + 8, c)) =
            E::pack(dp[t][2], dp[t][3]);
      }
      __syncthreads();

      // ---------------- phase B: dV += P^T dO, dK += dS^T Q -----------------------------------
#pragma unroll
      for (int ks = 0; ks < BM / 16; ++ks) {
        uint32_t ap[4], ad[4];
        ldsm_x4(ap, fpB(0, ks * 16));
        ldsm_x4(ad, fdsB(0, ks * 16));
#pragma unroll
        for (int dq = 0; dq < DB / 16; ++dq) {
          uint32_t bo[4], bq[4];
          ldsm_x4_t(bo, foB(ks * 16, dq * 16));
          ldsm_x4_t(bq, fqB(ks * 16, dq * 16));
          E::mma(dv[2 * dq], ap, bo[0], bo[1]);
          E::mma(dv[2 * dq + 1], ap, bo[2], bo[3]);
          E::mma(dk[2 * dq], ad, bq[0], bq[1]);
          E::mma(dk[2 * dq + 1], ad, bq[2], bq[3]);
        }
      }

      // ---------------- next active query block ----------------------------------------------
      int next = m + 1;
      if (has_mask) {
        if (cand) {
          cp_async_wait<0>();
          if (!p.mask_vec) __syncthreads();  // vector path: own copies only
          bool act = tile_any<BN, Tr::kMaskPitch, NT>(sMask + (cur ^ 1) * Tr::kMaskTile,
                                                      mask_rows, tid);
          while (!act) {
            ++next;
            if (next > m_last) break;
            load_mask(next, cur ^ 1);
            cp_async_commit();
            cp_async_wait<0>();
            if (!p.mask_vec) __syncthreads();  // vector path: own copies only
            act = tile_any<BN, Tr::kMaskPitch, NT>(sMask + (cur ^ 1) * Tr::kMaskTile, mask_rows,
                                                   tid);
          }
        } else {
          next = m_last + 1;
        }
      }
      __syncthreads();  // Q, dO, P (and the bias alias) free for the next block
      if (next <= m_last) load_step(next);

      // ---------------- phase C: dQ += dS K ---------------------------------------------------
      if (p.compute_dq) {
        float* dqg = p.dq_accum + s.q_offset(b, h);
#pragma unroll
        for (int ch = 0; ch < DC / CH; ++ch) {
          float acc[CH / 8][4];
#pragma unroll
          for (int t = 0; t < CH / 8; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;
#pragma unroll
          for (int ks = 0; ks < BN / 16; ++ks) {
            uint32_t a[4];
            ldsm_x4_t(a, fdsC(ks * 16, 0));
#pragma unroll
            for (int dq = 0; dq < CH / 16; ++dq) {
              uint32_t bk[4];
              ldsm_x4_t(bk, fkC(ks * 16, ch * CH + dq * 16));
              E::mma(acc[2 * dq], a, bk[0], bk[1]);
              E::mma(acc[2 * dq + 1], a, bk[2], bk[3]);
            }
          }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          // Lanes tq and tq^1 swap halves so that each owns 4 consecutive columns of one row:
          // the even lane row g, the odd lane row g + 8; one 16-byte vector atomic each.
          {
            const bool odd = (tq & 1) != 0;
            const int i = m0 + mc * 16 + g + (odd ? 8 : 0);
            float* row = dqg + static_cast<int64_t>(i) * q_rs + dcc0 + ch * CH + 4 * (tq >> 1);
#pragma unroll
            for (int t = 0; t < CH / 8; ++t) {
              const float r0 = __shfl_xor_sync(0xffffffffu, odd ? acc[t][0] : acc[t][2], 1);
              const float r1 = __shfl_xor_sync(0xffffffffu, odd ? acc[t][1] : acc[t][3], 1);
              const float4 v = odd ? make_float4(r0, r1, acc[t][2], acc[t][3])
                                   : make_float4(acc[t][0], acc[t][1], r0, r1);
              if (i < L.q_len) atomicAdd(reinterpret_cast<float4*>(row + t * 8), v);
            }
          }
#else
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int i = m0 + mc * 16 + g + half * 8;
            if (i < L.q_len) {
              float* row = dqg + static_cast<int64_t>(i) * q_rs + dcc0 + ch * CH + 2 * tq;
#pragma unroll
              for (int t = 0; t < CH / 8; ++t) {
                atomicAdd(row + t * 8, acc[t][2 * half]);
                atomicAdd(row + t * 8 + 1, acc[t][2 * half + 1]);
              }
            }
          }
#endif
        }
      }

      if (has_mask) cur ^= 1;
      m = next;
    }

    // Flush the per-key dbias sums when the next pair writes another entry (or at the end).
    if (db_rowsum) {
      bool flush = pi + 1 == pairs;
      if (!flush) {
        const int64_t b2 = batch_of(p, cls, (pi + 1) / G);
        const int h2 = hk * G + static_cast<int>((pi + 1) % G);
        flush = dop.offset(s.batch, b2, h2) != dbias_entry;
      }
      if (flush && db_dirty) {  // db_dirty is CTA-uniform
        float v0 = db_acc[0], v1 = db_acc[1];
        v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
        v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
        v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
        v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
        __syncthreads();
        if (tq == 0) {
          atomicAdd(sDB + kr0 + g, v0);
          atomicAdd(sDB + kr0 + g + 8, v1);
        }
        __syncthreads();
        if (tid < BN && n0 + tid < Lk) {
          const float v = sDB[tid];
          const int64_t off = dbias_entry + static_cast<int64_t>(n0 + tid) * dop.col_stride;
          if (dbias_mode == kDbiasDirect) {
            static_cast<T*>(p.dbias)[off] = E::from_float(v);
          } else if (v != 0.f) {
            atomicAdd(p.dbias_accum + off, v);
          }
        }
        __syncthreads();
        if (tid < BN) sDB[tid] = 0.f;
        db_acc[0] = db_acc[1] = 0.f;
        db_dirty = false;
      }
    }
  }

  // ---- epilogue: dK = scale * sum dS^T Q, dV ---------------------------------------------
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int t = 0; t < DB / 8; ++t) {
    const int c = dc0 + t * 8 + 2 * tq;
    *reinterpret_cast<uint32_t*>(sK + TileKV::off(kr0 + g, c)) =
        E::pack(dk[t][0] * p.scale, dk[t][1] * p.scale);
    *reinterpret_cast<uint32_t*>(sK + TileKV::off(kr0 + g + 8, c)) =
        E::pack(dk[t][2] * p.scale, dk[t][3] * p.scale);
    *reinterpret_cast<uint32_t*>(sV + TileKV::off(kr0 + g, c)) = E::pack(dv[t][0], dv[t][1]);
    *reinterpret_cast<uint32_t*>(sV + TileKV::off(kr0 + g + 8, c)) = E::pack(dv[t][2], dv[t][3]);
  }
  __syncthreads();
  const int64_t dkv_off = p.dkv_batch.offset(s.batch, b_rep) + static_cast<int64_t>(hk) * D +
                          static_cast<int64_t>(n0) * kv_rs;
  store_tile<BN, D, NT>(static_cast<T*>(p.dk) + dkv_off, sK, kv_rs, Lk - n0, tid);
  store_tile<BN, D, NT>(static_cast<T*>(p.dv) + dkv_off, sV, kv_rs, Lk - n0, tid);
}

// softmax_d[b, h, i] = sum_d dout * out - dlse. One warp per (b, i, h) row.
template <int D, typename T>
__global__ void bwd_preprocess(const __grid_constant__ BwdParams p, const T* out,
                               const float* dlse, float* softmax_d, int64_t rows) {
  using E = detail::Elem<T>;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const T* o = out + r * D;
  const T* d = static_cast<const T*>(p.dout) + r * D;
  float acc = 0.f;
#pragma unroll
  for (int c = lane * 2; c < D; c += 64) {
    const float2 x = E::unpack(*reinterpret_cast<const uint32_t*>(o + c));
    const float2 y = E::unpack(*reinterpret_cast<const uint32_t*>(d + c));
    acc += x.x * y.x + x.y * y.y;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const int64_t H = p.s.num_heads, Lq = p.s.seqlen_q;
    const int64_t h = r % H;
    const int64_t i = (r / H) % Lq;
    const int64_t b = r / (H * Lq);
    const int64_t off = p.s.lse_offset(b, h) + i;
    softmax_d[off] = acc - (dlse != nullptr ? dlse[off] : 0.f);
  }
}

// dq = scale * accumulator (8 elements per thread; the element count is a multiple of 8).
template <typename T>
__global__ void bwd_dq_convert(const float* __restrict__ acc, T* __restrict__ dq, float scale,
                               int64_t n8) {
  using E = detail::Elem<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  const float4 a = reinterpret_cast<const float4*>(acc)[2 * i];
  const float4 c = reinterpret_cast<const float4*>(acc)[2 * i + 1];
  uint4 o;
  o.x = E::pack(a.x * scale, a.y * scale);
  o.y = E::pack(a.z * scale, a.w * scale);
  o.z = E::pack(c.x * scale, c.y * scale);
  o.w = E::pack(c.z * scale, c.w * scale);
  reinterpret_cast<uint4*>(dq)[i] = o;
}

template <typename T>
__global__ void dbias_convert(const float* __restrict__ acc, T* __restrict__ dbias, int64_t n) {
  using E = detail::Elem<T>;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dbias[i] = E::from_float(acc[i]);
  }
}

}  // namespace dmattn::cuda
