// Consumer main loop of the Hopper backward: one warpgroup, 64 keys of the CTA's block, per
// query block (64 rows, ring slot `slot`, dS slot `ds_ring.slot`):
//
//   S^T  = K Q^T,  dP^T = V dO^T       wgmma, both operands in shared memory (two groups)
//   P^T  = exp(S^T - lse), 0 where lengths / the diagonal window / the mask hide a pair
//   dS^T = P^T (dP^T - D)              -> dS tile [query][key] in shared memory (stmatrix .trans)
//   dV  += P^T dO,  dK += dS^T Q       wgmma, P / dS from registers
//   dQ   = dS K     (this warpgroup's half of the head dim, every key of the block, once both
//                    warpgroups' dS are stored) -> the block's dQ stage, reduced by its dQ warp
//
// Gated kernels (kGate): S^T starts from the factored gate's bound (gate_scores_t), P^T takes its
// weight (weigh_gate_t), and while the dK GEMM runs, dalpha and ddelta gain the block's sums of
// dS sigmoid(-alpha delta) (add_gate_grads_t).
// Q and dO leave the ring as soon as the GEMMs reading them are done; with a bias the dS slot
// leaves its own ring once the dQ GEMM is done and any dbias store has read it. The accumulator
// layout is that of mma.sync m16n8 tiles side by side (sm90.cuh): element 4 t + e of S^T is key
// 16 warp + g + 8 (e / 2), query 8 t + 2 tq + e % 2.
#pragma once

#include <type_traits>

#include "cuda/gate.cuh"
#include "cuda/sm90/bwd_producer.cuh"
#include "cuda/sm90/fwd_scores.cuh"

namespace dmattn::cuda::sm90 {

// The shared-memory descriptors of a consumer warpgroup's GEMMs, ring slot 0 (a slot adds its
// byte offset).
template <typename Tr>
struct BwdOperands {
  uint64_t k_rows, v_rows;  // A of S^T, dP^T: the warpgroup's 64 keys, K-major
  uint64_t q_kmajor, do_kmajor;  // B of S^T, dP^T
  uint64_t q_mnmajor, do_mnmajor;  // B of dK, dV (queries down the rows)
  uint64_t ds_kmajor;   // A of dQ: dS [query][key], keys along K
  uint64_t k_cols;      // B of dQ: the warpgroup's dQ columns of K, keys down the rows
  __device__ __forceinline__ BwdOperands(uint32_t base, int wg) {
    const uint32_t rows = static_cast<uint32_t>(wg * Tr::kKeys * 128);
    k_rows = detail::gmma_desc(base + Tr::kOffK + rows, 0);
    v_rows = detail::gmma_desc(base + Tr::kOffV + rows, 0);
    q_kmajor = detail::gmma_desc(base + Tr::kOffQ, 0);
    do_kmajor = detail::gmma_desc(base + Tr::kOffdO, 0);
    q_mnmajor = detail::gmma_desc(base + Tr::kOffQ, Tr::BM * 128);
    do_mnmajor = detail::gmma_desc(base + Tr::kOffdO, Tr::BM * 128);
    ds_kmajor = detail::gmma_desc(base + Tr::kOffdS, 0);
    k_cols = detail::gmma_desc(
        base + Tr::kOffK + detail::mnmajor_col(wg * Tr::kDqCols, Tr::BN), Tr::BN * 128);
  }
};

// acc = A B^T over the head dim (S^T or dP^T): A the warpgroup's keys, B the block's queries
// (kOverwrite false: acc += A B^T).
template <typename Tr, typename T, bool kOverwrite = true>
__device__ __forceinline__ void issue_scores_t(float (&acc)[Tr::BM / 2], uint64_t a, uint64_t b) {
  detail::wgmma_async(
      [&] {
        detail::wgmma_issue<0, 0, Tr::D / 16, kOverwrite>(
            acc, a, b, [](int ks) { return detail::kmajor_step(ks, Tr::BN); },
            [](int ks) { return detail::kmajor_step(ks, Tr::BM); }, T());
      },
      acc);
}

// acc += X^T Y over the block's queries (dV or dK): X^T from registers, Y (Q or dO) in smem.
template <typename Tr, typename T>
__device__ __forceinline__ void issue_key_grad(float (&acc)[Tr::D / 2],
                                               const uint32_t (&x)[Tr::BM / 16][4], uint64_t y) {
  detail::wgmma_async(
      [&] {
        detail::wgmma_issue_rs<1, Tr::BM / 16>(
            acc, x, y, [](int ks) { return detail::mnmajor_step(ks); }, T());
      },
      acc);
}

// dq = dS K over the block's keys (this warpgroup's dQ columns).
template <typename Tr, typename T>
__device__ __forceinline__ void issue_query_grad(float (&dq)[Tr::kDqCols / 2], uint64_t ds,
                                                 uint64_t k) {
  auto ds_step = [](int ks) { return detail::kmajor_step(ks, Tr::BM); };
  auto k_step = [](int ks) { return detail::mnmajor_step(ks); };
  detail::wgmma_async(
      [&] { detail::wgmma_issue<0, 1, Tr::BN / 16, true>(dq, ds, k, ds_step, k_step, T()); }, dq);
}

// P^T = exp(S^T - lse) in place (0 where hidden); lse of the block's rows at `lse`.
template <typename Tr>
__device__ __forceinline__ void probabilities_t(float (&s)[Tr::BM / 2], const float* lse,
                                                const BwdParams& p, const QueuedRows& blk,
                                                const detail::Band& band, int key0,
                                                const ConsumerThread& th) {
  const detail::SeqLens& L = blk.lens;
  // Whether any pair of the warpgroup's 64 keys x the block's rows may be hidden (uniform).
  const int wg_key0 = key0 - 16 * th.warp - th.g;
  const bool bounds = blk.m0 + Tr::BM > L.q_len || wg_key0 + Tr::kKeys > L.kv_len ||
                      wg_key0 - (blk.m0 + Tr::BM - 1) < band.dmin ||
                      wg_key0 + Tr::kKeys - 1 - blk.m0 > band.dmax;
#pragma unroll
  for (int t = 0; t < Tr::BM / 8; ++t) {
    const float* l = lse + 8 * t + 2 * th.tq;
    // lse = -inf (no visible key) gives P = 0 without an inf - inf.
    const float l2[2] = {l[0] == -INFINITY ? INFINITY : l[0] * detail::kLog2e,
                         l[1] == -INFINITY ? INFINITY : l[1] * detail::kLog2e};
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * t + e] = detail::fast_exp2(s[4 * t + e] * p.softmax_mul - l2[e & 1]);
  }
  // A loop of its own: inside the exp loop the test stays predicated on every block.
  if (!bounds) return;
#pragma unroll
  for (int t = 0; t < Tr::BM / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = blk.m0 + 8 * t + 2 * th.tq + (e & 1), j = key0 + 8 * (e >> 1);
      const bool in = i < L.q_len && j < L.kv_len && j - i >= band.dmin && j - i <= band.dmax;
      s[4 * t + e] = in ? s[4 * t + e] : 0.f;
    }
}

// The address that lane l gives ldmatrix / stmatrix .trans for the 8 x 8 blocks (keys + 0, + 8)
// x (queries 16 kq, + 8) of the warp's 16 keys in the dS tile [query][key] (a SwizzledTile, keys
// in 64-column panels): row l % 8 (a query) of block l / 8. A warp reads its bias and writes its
// dS only there.
template <typename Tr>
__device__ __forceinline__ uint32_t ds_blocks(uint32_t tile, int kq, int key_local,
                                              const ConsumerThread& th) {
  const int block = th.lane / 8;
  const int key = key_local - th.g + 8 * (block % 2);
  const int query = 16 * kq + 8 * (block / 2) + th.lane % 8;
  return tile + 2 * detail::SwizzledTile<Tr::BM, Tr::BN>::off(query, key);
}

// S^T = bias^T * mul (the scores' units: the bias over the softmax scale), which the S^T GEMM
// then accumulates into (holding no registers beside its accumulators). The block's bias tile
// sits in its dS slot ([query][key] as dS, read by ldmatrix .trans at ds_blocks: a warp reads
// only the keys it later overwrites with dS), or its one row of keys in the slot's bias row.
template <typename Tr, typename T>
__device__ __forceinline__ void bias_scores_t(float (&s)[Tr::BM / 2], uint32_t tile, const T* row,
                                              bool one_row, float mul, int key_local,
                                              const ConsumerThread& th) {
  using E = detail::Elem<T>;
  if (one_row) {
    const float b[2] = {E::to_float(row[key_local]) * mul, E::to_float(row[key_local + 8]) * mul};
#pragma unroll
    for (int i = 0; i < Tr::BM / 2; ++i) s[i] = b[(i % 4) / 2];
    return;
  }
#pragma unroll
  for (int kq = 0; kq < Tr::BM / 16; ++kq) {
    uint32_t pairs[4];  // pairs[j]: keys + 8 (j % 2), queries 16 kq + 8 (j / 2) + 2 tq, + 1
    detail::ldsm_x4_t(pairs, ds_blocks<Tr>(tile, kq, key_local, th));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 b = E::unpack(pairs[j]);
      s[8 * kq + 2 * j] = b.x * mul;
      s[8 * kq + 2 * j + 1] = b.y * mul;
    }
  }
}

// P^T = 0 where the block's mask bits (`tile`: BM rows of BN / 8 bytes, one row when the mask is
// broadcast over queries) hide a pair. The thread's keys, key_local and key_local + 8, are bit g
// of two consecutive bytes of a row.
template <typename Tr>
__device__ __forceinline__ void apply_mask_t(float (&s)[Tr::BM / 2], const uint8_t* tile,
                                             bool one_row, int key_local,
                                             const ConsumerThread& th) {
  const uint8_t* bytes = tile + (key_local - th.g) / 8;
#pragma unroll
  for (int t = 0; t < Tr::BM / 8; ++t)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = one_row ? 0 : 8 * t + 2 * th.tq + r;
      const uint32_t bits = *reinterpret_cast<const uint16_t*>(bytes + row * (Tr::BN / 8)) >> th.g;
      s[4 * t + r] = bits & 1 ? s[4 * t + r] : 0.f;
      s[4 * t + 2 + r] = bits & 0x100 ? s[4 * t + 2 + r] : 0.f;
    }
}

// The gate of a block in its ring slot: alpha of the block's rows, then delta of the CTA's
// keys. The consumers read it where they use it (held across the block's GEMMs, the factors
// cost them spills).
template <typename Tr>
struct BwdGateSlot {
  const float* alpha;
  const float* delta;
  __device__ __forceinline__ BwdGateSlot(const uint8_t* smem, int slot)
      : alpha(reinterpret_cast<const float*>(smem + Tr::kOffGate + slot * Tr::kGateBytes)),
        delta(alpha + Tr::BM) {}
  // alpha_i of S^T's element 4 t + e.
  __device__ __forceinline__ float row(int t, int e, const ConsumerThread& th) const {
    return alpha[8 * t + 2 * th.tq + (e & 1)];
  }
};

// S^T = min(alpha_i delta_j, 0) / scale: the factored gate's bound (gate.cuh) in the scores'
// units, which the S^T GEMM then accumulates into (as bias_scores_t: computed before the GEMMs, no
// accumulator in flight but dK's and dV's); weigh_gate_t completes it on P^T.
template <typename Tr>
__device__ __forceinline__ void gate_scores_t(float (&s)[Tr::BM / 2], const BwdGateSlot<Tr>& gate,
                                              int key_local, float mul,
                                              const ConsumerThread& th) {
  const float d_mul[2] = {gate.delta[key_local] * mul, gate.delta[key_local + 8] * mul};
#pragma unroll
  for (int t = 0; t < Tr::BM / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[4 * t + e] = detail::gate_bound(gate.row(t, e, th) * d_mul[e >> 1]);
    }
}

// P^T *= sigmoid(|alpha_i delta_j|), the factored gate's weight (as the forward's GateWeights).
template <typename Tr>
__device__ __forceinline__ void weigh_gate_t(float (&pt)[Tr::BM / 2], const BwdGateSlot<Tr>& gate,
                                             int key_local, const ConsumerThread& th) {
  const float d_half[2] = {0.5f * gate.delta[key_local], 0.5f * gate.delta[key_local + 8]};
#pragma unroll
  for (int t = 0; t < Tr::BM / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pt[4 * t + e] *= detail::gate_weight(gate.row(t, e, th) * d_half[e >> 1]);
    }
}

// Element 4 t + e of S^T's layout from its pairs packed as a wgmma A operand (pack_probabilities).
template <typename T>
__device__ __forceinline__ float ds_element(const uint32_t (&ds)[4][4], int t, int e) {
  const float2 pair = detail::Elem<T>::unpack(ds[t / 2][2 * (t % 2) + e / 2]);
  return e % 2 ? pair.y : pair.x;
}

// The gate's gradients of the block from dS^T (the logits' cotangent, ds, as the dK GEMM's
// operand: rounded to T as in the FlashAttention-2-class kernels' dS tile): w_ij = dS_ij
// sigmoid(-alpha_i delta_j) adds w_ij delta_j to dalpha_i and w_ij alpha_i to ddelta_j, each a
// sum over the thread's pairs, then over the lanes that share its rows (g) or keys (tq) by
// shuffles, then one fp32 atomic a row and key of the warp. Rows and keys past the lengths have
// dS = 0 (P^T = 0 there) but no gradient element: skipped. hk: the CTA's kv head.
template <typename Tr, typename T>
__device__ __forceinline__ void add_gate_grads_t(const uint32_t (&ds)[Tr::BM / 16][4],
                                                 const BwdGateSlot<Tr>& gate, const BwdParams& p,
                                                 const QueuedBlock& blk, int key_local, int key0,
                                                 int hk, const ConsumerThread& th) {
  const AttentionShape& s = p.s;
  // the thread's keys' delta times log2(e), undone in the rows' sums
  const float delta2[2] = {gate.delta[key_local] * detail::kLog2e,
                           gate.delta[key_local + 8] * detail::kLog2e};
  float keys[2] = {0.f, 0.f};
  // The rows in two halves of 4 t (8 sums a thread, fewer registers live): rows[2 t' + r] is
  // row 8 (t0 + t') + 2 tq + r; halving over the 8 lanes of one tq leaves lane l with
  // rows[g], row 8 (t0 + g / 2) + 2 tq + g % 2.
  constexpr int kHalf = Tr::BM / 16;
  static_assert(kHalf == 4, "8 row sums a thread over 8 lanes: one a lane");
#pragma unroll
  for (int t0 = 0; t0 < Tr::BM / 8; t0 += kHalf) {
    float rows[2 * kHalf];
#pragma unroll
    for (int t = 0; t < kHalf; ++t) {
      rows[2 * t] = rows[2 * t + 1] = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float w = ds_element<T>(ds, t0 + t, e) *
                        detail::log_sigmoid_grad_log2(gate.row(t0 + t, e, th) * delta2[e >> 1]);
        rows[2 * t + (e & 1)] += w * delta2[e >> 1];
        keys[e >> 1] += w * gate.row(t0 + t, e, th);
      }
    }
#pragma unroll
    for (int half = kHalf, o = 16; half > 0; half >>= 1, o >>= 1) {
      const bool upper = th.lane & o;
#pragma unroll
      for (int k = 0; k < half; ++k) {
        const float other = __shfl_xor_sync(0xffffffffu, upper ? rows[k] : rows[k + half], o);
        rows[k] = (upper ? rows[k + half] : rows[k]) + other;
      }
    }
    const int i = blk.m0 + 8 * (t0 + th.g / 2) + 2 * th.tq + th.g % 2;
    if (i < blk.lens.q_len) {
      atomicAdd(p.dalpha + s.alpha_offset(blk.b, blk.h) + int64_t{i} * s.num_heads,
                rows[0] * detail::kLn2);
    }
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    keys[k] += __shfl_xor_sync(0xffffffffu, keys[k], 1);
    keys[k] += __shfl_xor_sync(0xffffffffu, keys[k], 2);
    const int j = key0 + 8 * k;
    if (th.tq == 0 && j < blk.lens.kv_len) {
      atomicAdd(p.ddelta + s.delta_offset(blk.b, hk) + int64_t{j} * s.num_kv_heads, keys[k]);
    }
  }
}

// dS^T = P^T (dP^T - D) in place of dP^T; D of the block's rows at `dsum`.
template <typename Tr>
__device__ __forceinline__ void score_grads_t(float (&dp)[Tr::BM / 2],
                                              const float (&pt)[Tr::BM / 2], const float* dsum,
                                              const ConsumerThread& th) {
#pragma unroll
  for (int t = 0; t < Tr::BM / 8; ++t) {
    const float* d = dsum + 8 * t + 2 * th.tq;
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[4 * t + e] = pt[4 * t + e] * (dp[4 * t + e] - d[e & 1]);
  }
}

// The warpgroup's dS into the dS tile [query][key] (the dQ GEMM's K-major A and dbias's layout)
// by stmatrix .trans: ds[kq] holds the blocks of ds_blocks(kq).
template <typename Tr>
__device__ __forceinline__ void store_score_grads(uint32_t tile,
                                                  const uint32_t (&ds)[Tr::BM / 16][4],
                                                  int key_local, const ConsumerThread& th) {
#pragma unroll
  for (int kq = 0; kq < Tr::BM / 16; ++kq) {
    detail::stsm_x4_t(ds_blocks<Tr>(tile, kq, key_local, th), ds[kq]);
  }
}

// The warpgroup's dQ columns into the dQ stage (StagedDq's layout, rows 16 warp + g, + 8). The
// stage's swizzle sees a row's index mod 4 and repeats every 32 columns.
template <typename Tr>
__device__ __forceinline__ void store_dq(float* stage, const float (&dq)[Tr::kDqCols / 2],
                                         const ConsumerThread& th) {
  const int r = 16 * th.warp + th.g;
  float* row = stage + r * Tr::D + th.wg * Tr::kDqCols;
#pragma unroll
  for (int t = 0; t < Tr::kDqCols / 8; ++t) {
    const int col = StagedDq::column(r, (t % 4) * 8 + 2 * th.tq) + (t / 4) * 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      *reinterpret_cast<float2*>(row + half * 8 * Tr::D + col) =
          make_float2(dq[4 * t + 2 * half], dq[4 * t + 2 * half + 1]);
    }
  }
}

// Every query block of the CTA; dK (unscaled) and dV of the warpgroup's keys accumulate in dk, dv.
template <typename Tr, typename T>
__device__ __forceinline__ void consume(const BwdParamsSm90& P, uint8_t* smem,
                                        const BwdBarriers<Tr>& bar, const BlockQueue<Tr>& queue,
                                        const BwdCtaWork& w, const ConsumerThread& th,
                                        int wg_uniform,
                                        float (&dk)[Tr::D / 2], float (&dv)[Tr::D / 2]) {
  const BwdParams& p = P.p;
  const BwdOperands<Tr> ops(detail::smem_u32(smem), wg_uniform);
  const float* lse_slots = reinterpret_cast<const float*>(smem + Tr::kOffLse);
  const float* dsum_slots = reinterpret_cast<const float*>(smem + Tr::kOffDsum);
  float* dq_stages = reinterpret_cast<float*>(smem + Tr::kOffDq);
  const int key_local = th.wg * Tr::kKeys + 16 * th.warp + th.g;
  const int key0 = w.n0 + key_local;
#pragma unroll
  for (int i = 0; i < Tr::D / 2; ++i) dk[i] = dv[i] = 0.f;

  mbar_wait(bar.kv_full(), 0);
  RingPos<Tr::kStages> ring;
  RingPos<Tr::kDsSlots> ds_ring;
  RingPos<Tr::kDqStages> dq_ring;
  // Gated kernels read the block's batch entry and head too: where its gate's gradients go.
  using Block = std::conditional_t<Tr::kGate, QueuedBlock, QueuedRows>;
  QueueReader<Tr, Block> blocks{queue};
  Block blk = blocks.next();
#pragma unroll 1
  while (blk.m0 >= 0) {
    const int slot = ring.slot;
    const uint32_t q_off = slot * Tr::kQBytes;
    float s[Tr::BM / 2], dp[Tr::BM / 2];

    // ---- GEMM: S^T = K Q^T, dP^T = V dO^T ---------------------------------------------------
    const uint32_t ds_off = ds_ring.slot * Tr::kDsBytes;
    const uint32_t ds_tile = detail::smem_u32(smem) + Tr::kOffdS + ds_off;
    mbar_wait(bar.q_full(slot), ring.parity);
    if constexpr (Tr::kBias) {
      bias_scores_t<Tr, T>(s, ds_tile,
                           reinterpret_cast<const T*>(smem + Tr::kOffBiasRow +
                                                      slot * Tr::kBiasRowBytes),
                           P.bias_tiles.one_row, p.bias_mul, key_local, th);
    }
    if constexpr (Tr::kGate) {
      gate_scores_t<Tr>(s, BwdGateSlot<Tr>(smem, slot), key_local, p.bias_mul, th);
    }
    issue_scores_t<Tr, T, !Tr::kBias && !Tr::kGate>(s, ops.k_rows,
                                                    detail::gmma_advance(ops.q_kmajor, q_off));
    mbar_wait(bar.do_full(slot), ring.parity);
    issue_scores_t<Tr, T>(dp, ops.v_rows, detail::gmma_advance(ops.do_kmajor, q_off));
    const Block next = blocks.next();  // while the GEMMs run: its pop waits on shared memory

    // ---- P^T, dS^T -------------------------------------------------------------------------
    detail::wgmma_wait<1>();
    detail::fence_operands(s);
    probabilities_t<Tr>(s, lse_slots + slot * Tr::kRowSlot + blk.row_shift, p, blk, w.band, key0,
                        th);
    if constexpr (Tr::kGate) weigh_gate_t<Tr>(s, BwdGateSlot<Tr>(smem, slot), key_local, th);
    if (Tr::kMasks && (blk.flags & kBlockMasked)) {
      apply_mask_t<Tr>(s, smem + Tr::kOffMask + slot * Tr::kMaskBytes, P.mask_tiles.one_row,
                       key_local, th);
    }
    detail::wgmma_wait<0>();
    detail::fence_operands(dp);
    score_grads_t<Tr>(dp, s, dsum_slots + slot * Tr::kRowSlot + blk.row_shift, th);
    uint32_t pf[Tr::BM / 16][4], dsf[Tr::BM / 16][4];
    pack_probabilities<T>(pf, s);
    pack_probabilities<T>(dsf, dp);
    store_score_grads<Tr>(ds_tile, dsf, key_local, th);

    // ---- GEMMs: dV += P^T dO; dQ = dS K (both warpgroups' dS stored); dK += dS^T Q ---------
    issue_key_grad<Tr, T>(dv, pf, detail::gmma_advance(ops.do_mnmajor, q_off));
    detail::fence_async_shared();
    named_sync(kBwdDsReadyBarrier, kConsumerThreads);
    float dq[Tr::kDqCols / 2];
    issue_query_grad<Tr, T>(dq, detail::gmma_advance(ops.ds_kmajor, ds_off),
                            ops.k_cols);
    issue_key_grad<Tr, T>(dk, dsf, detail::gmma_advance(ops.q_mnmajor, q_off));

    detail::wgmma_wait<2>();  // dV: dO is free
    detail::fence_operands(dv);
    th.release(bar.do_empty(slot));
    detail::wgmma_wait<1>();  // dQ: dS is free but for the dbias store
    detail::fence_operands(dq);
    if (Tr::kBias) th.release(bar.ds_empty(ds_ring.slot));
    named_sync(kBwdDqEmptyBarrier + dq_ring.slot, kDqHandoffThreads);
    store_dq<Tr>(dq_stages + dq_ring.slot * Tr::kDqBytes / 4, dq, th);
    detail::fence_async_shared();
    named_arrive(kBwdDqFullBarrier + dq_ring.slot, kDqHandoffThreads);
    dq_ring.advance();
    // while the dK GEMM runs (its dS operand only read): no accumulator but dK's and dV's live
    if constexpr (Tr::kGate) {
      add_gate_grads_t<Tr, T>(dsf, BwdGateSlot<Tr>(smem, slot), p, blk, key_local, key0,
                              w.cta.hk, th);
    }
    detail::wgmma_wait<0>();  // dK: Q is free
    detail::fence_operands(dk);
    if constexpr (Tr::kSegments || Tr::kGate) {
      mbar_arrive(bar.q_empty(slot));  // every thread (kQEmptyArrivals)
    } else {
      th.release(bar.q_empty(slot));
    }
    ring.advance();
    ds_ring.advance();
    blk = next;
  }
}

}  // namespace dmattn::cuda::sm90
