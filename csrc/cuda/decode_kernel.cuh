// Decode forward: a few query rows (Lq <= kDecodeMaxQueryRows) against many keys, where the time
// is the reading of K and V. The G = H / Hk query heads of a kv head and their rows share one
// tile (packed row r = i * G + g: query row i of query head hk * G + g), so each K/V tile is read
// once per kv head instead of once per query head.
//
// One CTA per (key split, row block, kv head, batch). K/V tiles of kDecodeBlockN keys stream
// through a kStages-deep cp.async ring, the walk naming the next tile that lengths, the position
// rule (causal / window / the kv head's window and sink) and the mask's block map leave visible.
// The warps form kRowGroups x KG: each takes 16 packed rows and a KG-th of every tile's keys:
//   S = bias / scale + Q K^T   (its rows, its keys)
//   softcap, then -inf where not visible (lengths, position, mask)
//   online softmax in fp32 with exp2, O += P V
// with its own running max and sum; the KG warps of a row group merge theirs once at the end.
// With split-KV each CTA writes a partial result as the FlashAttention-2-class forward's splits
// do; the last CTA of a (batch, kv head, row block) to finish merges them (fwd_combine.cuh's
// combine_row), counted in FwdParams::split_counters.
// Mask elements are read straight from global memory into the score layout (a row of at most
// kDecodeBlockN keys a tile, beside K/V tiles of kDecodeBlockN x D), two keys a load where the
// rows allow; the bias a tile ahead of its use, as decode_bias.cuh says.
#pragma once

#include <cmath>

#include "cuda/block_map.cuh"
#include "cuda/decode_bias.cuh"
#include "cuda/fwd_combine.cuh"
#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda {

// Keys per tile: one cell of the mask block map.
constexpr int kDecodeBlockN = kMaskMapCell;

template <int D_, int KG_, int kStages_>
struct DecodeTraits {
  static constexpr int D = D_, KG = KG_, kStages = kStages_;
  static constexpr int NW = 4, kNT = NW * 32;
  static constexpr int kRowGroups = NW / KG;
  static constexpr int RM = 16 * kRowGroups;  // packed rows of a CTA
  static constexpr int BN = kDecodeBlockN;
  static constexpr int KW = BN / KG;  // keys of a warp in each tile
  static constexpr int NTS = KW / 8;  // 8-col tiles of its S
  static constexpr int NTO = D / 8;   // 8-col tiles of O
  static_assert(NW % KG == 0 && KW % 16 == 0, "whole 16-key slices per warp");
  static_assert(kStages >= 2, "a ring");
  static_assert(kMinPageSize % BN == 0, "a key tile of a paged cache lies in one page");

  static constexpr int kTileBytes = BN * D * 2;
  static constexpr int kOffRing = RM * D * 2;  // after the Q tile
  static constexpr int kRingBytes = kStages * 2 * kTileBytes;
  static constexpr int kSmem = kOffRing + kRingBytes;
  // The merge of the KG warps' results reuses the ring: (max, sum) of every row and warp, then
  // the scaled outputs of warps 1 .. KG - 1 (then the flag of the splits' merge).
  static constexpr int kMergeBytes = (KG * RM * 2 + (KG - 1) * RM * D) * 4;
  static_assert(kMergeBytes + 4 <= kRingBytes, "the merge and its flag fit the ring");
  static_assert(kOffRing % 128 == 0 && kTileBytes % 128 == 0, "tiles start on 128-byte rows");
};

namespace detail {

// kTileAny | kTileAll of key block t of the mask entries of a kv head's G query heads (their
// rows lie in cell row 0): any where some head's cell has a visible element, all where every
// head's cell is all true.
struct GroupTileFlags {
  const uint8_t* cells;   // the first head's map entry
  int64_t entry_step;     // map bytes from one distinct entry to the next
  int entries;            // distinct mask entries among the G heads
  int cols;
  __device__ __forceinline__ int operator()(int t) const {
    const int c = cols == 1 ? 0 : t;
    int any = 0, all = kTileAll;
    for (int e = 0; e < entries; ++e) {
      const int f = __ldg(cells + e * entry_step + c);
      any |= f & kTileAny;
      all &= f;
    }
    return any ? (any | all) : 0;
  }
};

// One of this thread's two packed rows (r = row group base + lane / 4 + 8 * half).
struct DecodeRow {
  int i;      // query row
  bool live;  // a row of the call (r < G * Lq) within the query length
  const uint8_t* mask;  // its mask row (null without a mask or when not live)
  const void* bias;     // its bias row (of T), likewise
};

}  // namespace detail

// Two CTAs an SM (DecodeCtasPerSm): with no minimum given, ptxas held the KG = 4 kernel to 168
// registers and spilled. kPaged: k and v are a paged cache (AttentionShape::pages), each tile's
// page looked up in p.page_table; a kernel of its own, so that a contiguous cache pays nothing.
template <typename Tr, typename T, bool kPaged>
__global__ void __launch_bounds__(Tr::kNT, 2) decode_kernel(const __grid_constant__ FwdParams p) {
  using namespace detail;
  using E = Elem<T>;
  constexpr int D = Tr::D, BN = Tr::BN, KW = Tr::KW, KG = Tr::KG, RM = Tr::RM, NT = Tr::kNT;
  constexpr int S = Tr::kStages, NTS = Tr::NTS, NTO = Tr::NTO;
  using TileQ = SwizzledTile<RM, D>;

  extern __shared__ __align__(128) uint8_t smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* ring = reinterpret_cast<T*>(smem + Tr::kOffRing);  // slot k: K, then V

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int kg = warp % KG, row_group = warp / KG;
  const AttentionShape& s = p.s;

  const int H = static_cast<int>(s.num_heads), Hk = static_cast<int>(s.num_kv_heads);
  const int G = H / Hk;
  const int Lq = static_cast<int>(s.seqlen_q);
  const int rows = G * Lq;
  int64_t bid = blockIdx.x;
  const int split = static_cast<int>(bid % p.num_splits);
  bid /= p.num_splits;
  const int r0 = static_cast<int>(bid % p.m_blocks) * RM;
  bid /= p.m_blocks;
  const int hk = static_cast<int>(bid % Hk);
  const int64_t b = bid / Hk;
  const SeqLens L = seq_lens(s, p.q_lens, p.kv_lens, b);
  const PositionRule rule = position_rule(s, p.windows, hk);

  const int64_t q_rs = s.q_row_stride(), kv_rs = s.kv_row_stride();
  const T* kg_ptr = static_cast<const T*>(p.k) + s.kv_offset(b, hk);
  const T* vg_ptr = static_cast<const T*>(p.v) + s.kv_offset(b, hk);
  const int32_t* table_row = kPaged ? s.pages.table_row(p.page_table, s.batch, b) : nullptr;
  const bool has_mask = p.mask != nullptr, has_bias = p.bias != nullptr;

  // Key blocks the CTA's query rows may see by position and length, and this split's share.
  const int i_first = r0 / G, i_last = (min(r0 + RM, rows) - 1) / G;
  const SeqLens rows_lens{min(L.q_len, i_last + 1), L.kv_len};
  const KeyBlocks visible = visible_key_blocks<kMaskMapCell, BN>(rows_lens, rule, i_first);
  const int n_lo = max(visible.all.lo, split * p.split_blocks);
  const int n_hi = min(visible.all.hi, (split + 1) * p.split_blocks);

  GroupTileFlags group_flags{};
  if (has_mask) {
    const int64_t hpe = s.mask.heads_per_entry;
    const int step = static_cast<int>(hpe < G ? hpe : G);  // heads from one entry to the next
    const int64_t h0 = static_cast<int64_t>(hk) * G;
    const MaskMapView first(p.mask_map, s, b, h0);
    group_flags = {first.cells, 0, G / step, first.cols};
    if (group_flags.entries > 1) {
      group_flags.entry_step = MaskMapView(p.mask_map, s, b, h0 + step).cells - first.cells;
    }
  }
  auto walk = TileWalk<-1, GroupTileFlags>(has_mask, group_flags, n_lo - 1);
  auto next_block = [&](int n, int* flags) {
    return visible.gap.next(n, flags, [&](int m, int* f) { return walk.next(m, f); });
  };

  // This thread's two rows.
  DecodeRow row[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + row_group * 16 + g + half * 8;
    DecodeRow& w = row[half];
    const int h = hk * G + r % G;
    w.i = r / G;
    w.live = r < rows && w.i < L.q_len;
    w.mask = has_mask && w.live
                 ? p.mask + s.mask.offset(s.batch, b, h) + w.i * s.mask.row_stride
                 : nullptr;
    w.bias = has_bias && w.live ? static_cast<const T*>(p.bias) + s.bias.offset(s.batch, b, h) +
                                      w.i * s.bias.row_stride
                                : nullptr;
  }

  // Every row of the call in this CTA is within the query length (the tile's rows past the
  // call's are never stored).
  const bool rows_live = i_last < L.q_len;

  // ---- prologue: Q, then the first S - 1 visible tiles ---------------------------------------
  {
    constexpr int kChunksPerRow = D / 8;
    static_assert(RM * kChunksPerRow % NT == 0, "Q chunks divide among the threads");
#pragma unroll
    for (int k = 0; k < RM * kChunksPerRow / NT; ++k) {
      const int id = tid + k * NT;
      const int rl = id / kChunksPerRow, c = (id % kChunksPerRow) * 8;
      const int r = r0 + rl;
      const bool ok = r < rows;
      const T* src = static_cast<const T*>(p.q) +
                     (ok ? s.q_offset(b, hk * G + r % G) + (r / G) * q_rs + c : 0);
      cp_async16(smem_u32(sQ + TileQ::off(rl, c)), src, ok ? 16 : 0);
    }
    cp_async_commit();
  }
  // The next visible tile to load (n_lo - 1: none). In a paged cache a tile lies in one page,
  // whose table entry is read as soon as the tile is known: a tile of work before its loads,
  // which a dependent load would stall.
  int upcoming = n_lo - 1, upcoming_flags = 0;
  int32_t upcoming_page = 0;
  auto advance = [&](int from) {
    upcoming = next_block(from, &upcoming_flags);
    if (kPaged && upcoming >= 0) {
      upcoming_page = __ldg(table_row + s.pages.entry_of(upcoming * BN));
    }
  };
  auto load_upcoming = [&](int slot) {
    T* sK = ring + slot * 2 * BN * D;
    const int n = upcoming;
    const int64_t first = kPaged ? s.pages.row_in(upcoming_page, n * BN)
                                 : static_cast<int64_t>(n) * BN;
    const int valid = L.kv_len - n * BN;
    // All tiles but the last are whole: their loads skip the bounds test (56 instructions a
    // warp and tile instead of 115).
    if (valid >= BN) {
      load_tile_async<BN, D, NT, false>(sK, kg_ptr + first * kv_rs, kv_rs, BN, tid);
      load_tile_async<BN, D, NT, false>(sK + BN * D, vg_ptr + first * kv_rs, kv_rs, BN, tid);
    } else {
      load_tile_async<BN, D, NT>(sK, kg_ptr + first * kv_rs, kv_rs, valid, tid);
      load_tile_async<BN, D, NT>(sK + BN * D, vg_ptr + first * kv_rs, kv_rs, valid, tid);
    }
  };
  if (n_hi > n_lo) advance(n_hi - 1);
  // In flight: the tiles of slots read_slot, read_slot + 1, ... (n_lo - 1: none).
  int queued[S - 1], queued_flags[S - 1];
#pragma unroll
  for (int k = 0; k < S - 1; ++k) {
    queued[k] = upcoming;
    queued_flags[k] = upcoming_flags;
    if (upcoming >= n_lo) {
      load_upcoming(k);
      advance(upcoming - 1);
    }
    cp_async_commit();
  }

  float o[NTO][4];
#pragma unroll
  for (int t = 0; t < NTO; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[t][e] = 0.f;
  float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
  const FragAddr<RM, D> fq(sQ, row_group * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                           (lane >> 4) * 8);

  // S's start, bias / scale, read a tile ahead (decode_bias.cuh)
  DecodeBias<BN, KW, NTS, T> bias(p, {row[0].bias, row[1].bias}, kg * KW, L.kv_len, lane);
  if (bias.present() && queued[0] >= n_lo) bias.load(queued[0]);

  // ---- main loop over the visible tiles ------------------------------------------------------
  for (int read_slot = 0; queued[0] >= n_lo; read_slot = read_slot + 1 == S ? 0 : read_slot + 1) {
    const int n = queued[0];
    const bool mask_test = has_mask && !(queued_flags[0] & kTileAll);
    cp_async_wait<S - 2>();
    __syncthreads();  // tile n landed; every warp is done with the slot read last step
    {
      const int refill = read_slot == 0 ? S - 1 : read_slot - 1;
#pragma unroll
      for (int k = 0; k < S - 2; ++k) {
        queued[k] = queued[k + 1];
        queued_flags[k] = queued_flags[k + 1];
      }
      queued[S - 2] = upcoming;
      queued_flags[S - 2] = upcoming_flags;
      if (upcoming >= n_lo) {
        load_upcoming(refill);
        advance(upcoming - 1);
      }
      cp_async_commit();
    }
    const T* sK = ring + read_slot * 2 * BN * D;
    const T* sV = sK + BN * D;
    const FragAddr<BN, D> fk(sK, (lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8);
    const FragAddr<BN, D> fv(sV, (lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8);

    const int c0 = kg * KW;  // this warp's first key in the tile
    const int j0 = n * BN + c0;

    // S = bias / scale + Q K^T
    float sc[NTS][4];
    bias.start(sc);
    if (bias.present() && queued[0] >= n_lo) bias.load(queued[0]);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      ldsm_x4(a, fq(0, ks * 16));
#pragma unroll
      for (int np = 0; np < KW / 16; ++np) {
        uint32_t bk[4];
        ldsm_x4(bk, fk(c0 + np * 16, ks * 16));
        E::mma(sc[2 * np], a, bk[0], bk[1]);
        E::mma(sc[2 * np + 1], a, bk[2], bk[3]);
      }
    }

    // softcap, then visibility: lengths, the position rule, the mask
    if (p.softcap > 0.f) {
      for_each_element<1, NTS>([&](int, int t, int e) {
        sc[t][e] = p.softcap * accurate_tanh(sc[t][e] * p.softcap_in);
      });
    }
    // Tiles that the key length and the band cover for every row need no element test (in
    // decoding, all but the last).
    const int j_last = n * BN + BN - 1;
    const bool covered = rows_live && !mask_test && j_last < L.kv_len &&
                         n * BN - i_last >= rule.band.dmin && j_last - i_first <= rule.band.dmax;
    if (!covered) {
      for_each_pair<1, NTS>([&](int, int t, int half) {
        const DecodeRow& w = row[half];
        const int j = j0 + t * 8 + 2 * tq;
        uint32_t keep = 0x0101u;  // a byte per key
        if (mask_test && w.live && j < L.kv_len) {
          if (p.mask_vec) {
            keep = __ldg(reinterpret_cast<const uint16_t*>(w.mask + j));
          } else {
            keep = w.mask[j * s.mask.col_stride];
            if (j + 1 < L.kv_len) {
              keep |= static_cast<uint32_t>(w.mask[(j + 1) * s.mask.col_stride]) << 8;
            }
          }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool in = w.live && j + e < L.kv_len && rule.sees(w.i, j + e) &&
                          ((keep >> (8 * e)) & 0xffu) != 0;
          if (!in) sc[t][2 * half + e] = -INFINITY;
        }
      });
    }

    online_softmax<1, NTS, NTO, true>(reinterpret_cast<float(&)[1][NTS][4]>(sc), row_m, row_l,
                                      reinterpret_cast<float(&)[1][NTO][4]>(o), p.softmax_mul);

    // O += P V
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      const uint32_t a[4] = {E::pack(sc[2 * kk][0], sc[2 * kk][1]),
                             E::pack(sc[2 * kk][2], sc[2 * kk][3]),
                             E::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                             E::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        ldsm_x4_t(bv, fv(c0 + kk * 16, dp * 16));
        E::mma(o[2 * dp], a, bv[0], bv[1]);
        E::mma(o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
  }

  // ---- epilogue: merge the KG warps of each row group, normalise, store ---------------------
  cp_async_wait<0>();
  __syncthreads();  // the ring is free for the merge
  float* merge_ml = reinterpret_cast<float*>(smem + Tr::kOffRing);  // [KG][RM][max, sum]
  float* merge_o = merge_ml + KG * RM * 2;                          // [KG - 1][RM][D]
  float lse[2], out_scale[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = row_l[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int rl = row_group * 16 + g + half * 8;
    float m_all = row_m[half], l_all = l;
    if constexpr (KG > 1) {
      if (tq == 0) {
        merge_ml[(kg * RM + rl) * 2] = row_m[half];
        merge_ml[(kg * RM + rl) * 2 + 1] = l;
      }
      __syncthreads();
      m_all = -INFINITY;
      for (int k = 0; k < KG; ++k) m_all = fmaxf(m_all, merge_ml[(k * RM + rl) * 2]);
      l_all = 0.f;
      if (m_all != -INFINITY) {
        for (int k = 0; k < KG; ++k) {
          const float m_k = merge_ml[(k * RM + rl) * 2];
          if (m_k != -INFINITY) {
            l_all += merge_ml[(k * RM + rl) * 2 + 1] * fast_exp2((m_k - m_all) * p.softmax_mul);
          }
        }
      }
    }
    const float mine =
        row_m[half] == -INFINITY ? 0.f : fast_exp2((row_m[half] - m_all) * p.softmax_mul);
    out_scale[half] = l_all > 0.f ? mine / l_all : 0.f;
    lse[half] = l_all > 0.f ? m_all * p.lse_mul + logf(l_all) : -INFINITY;
  }
#pragma unroll
  for (int t = 0; t < NTO; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[t][e] *= out_scale[e >> 1];
  if constexpr (KG > 1) {
    if (kg > 0) {
      for_each_pair<1, NTO>([&](int, int t, int half) {
        const int rl = row_group * 16 + g + half * 8;
        *reinterpret_cast<float2*>(merge_o + ((kg - 1) * RM + rl) * D + t * 8 + 2 * tq) =
            make_float2(o[t][2 * half], o[t][2 * half + 1]);
      });
    }
    __syncthreads();
    if (kg == 0) {
      for (int k = 1; k < KG; ++k) {
        for_each_pair<1, NTO>([&](int, int t, int half) {
          const int rl = row_group * 16 + g + half * 8;
          const float2 x = *reinterpret_cast<const float2*>(merge_o + ((k - 1) * RM + rl) * D +
                                                            t * 8 + 2 * tq);
          o[t][2 * half] += x.x;
          o[t][2 * half + 1] += x.y;
        });
      }
    }
  }

  const int64_t BH = s.batch_count() * H;
  const int row_end = min(r0 + RM, rows);
  auto flat_row = [&](int r) { return (b * H + hk * G + r % G) * Lq + r / G; };
  if (kg == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + row_group * 16 + g + half * 8;
      if (r >= row_end) continue;
      const int i = r / G, h = hk * G + r % G;
      float* lse_dst = p.lse + s.lse_offset(b, h) + i;
      int64_t o_at = s.q_offset(b, h) + i * q_rs;
      float* o_f32 = static_cast<float*>(p.out);
      if (p.num_splits > 1) {
        const int64_t at = split * BH * Lq + flat_row(r);
        lse_dst = p.lse_partial + at;
        o_f32 = p.o_partial;
        o_at = at * D;
      }
      if (tq == 0) *lse_dst = lse[half];
#pragma unroll
      for (int t = 0; t < NTO; ++t) {
        const float x0 = o[t][2 * half], x1 = o[t][2 * half + 1];
        const int64_t at = o_at + t * 8 + 2 * tq;
        if (p.num_splits > 1 || p.out_f32) {
          *reinterpret_cast<float2*>(o_f32 + at) = make_float2(x0, x1);
        } else {
          *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + at) = E::pack(x0, x1);
        }
      }
    }
  }

  // The last split of the group to finish merges the group's partial results.
  if (p.num_splits == 1 || p.split_counters == nullptr) return;
  int* merges = reinterpret_cast<int*>(smem + Tr::kOffRing + Tr::kMergeBytes);
  __threadfence();  // this CTA's partial results, before its count
  __syncthreads();
  if (tid == 0) {
    const int64_t group = (b * Hk + hk) * p.m_blocks + r0 / RM;
    *merges = atomicAdd(p.split_counters + group, 1) == p.num_splits - 1;
  }
  __syncthreads();
  if (!*merges) return;
  __threadfence();  // the other splits' results, after their counts
  for (int r = r0 + warp; r < row_end; r += Tr::NW) {
    combine_row<D, T>(p, flat_row(r), BH * Lq, lane);
  }
}

}  // namespace dmattn::cuda
