// The consumer side of the Hopper forward's scores: which accumulator elements a consumer thread
// holds, S(n) turned into the softmax's scores (+ bias / scale, the gate's bound, softcap, -inf
// where the mask, the lengths or the diagonal window hide a key), the online softmax (with the
// gate's weights), and P packed as the A operand of the P V wgmma. The accumulator layout is that
// of mma.sync m16n8 tiles side by side (sm90.cuh).
#pragma once

#include <cmath>

#include "cuda/sm90/fwd_producer.cuh"
#include "cuda/sm90/fwd_scheduler.cuh"
#include "cuda/sm90/fwd_traits.cuh"
#include "cuda/sm90/sync.cuh"

namespace dmattn::cuda::sm90 {

// A consumer thread: warpgroup `wg` of the consumers, its warp in the warpgroup, and the two
// accumulator rows g and g + 8 of that warp's 16 that it holds (columns 2 tq, 2 tq + 1 of each
// 8-column tile).
struct ConsumerThread {
  int wg, warp, lane, g, tq;
  __device__ __forceinline__ explicit ConsumerThread(int consumer_tid)
      : wg(consumer_tid / 128),
        warp((consumer_tid / 32) % 4),
        lane(consumer_tid % 32),
        g((consumer_tid % 32) / 4),
        tq(consumer_tid % 4) {}
  // The same with wg and warp from lane 0 through a shuffle: the compiler then knows them
  // warp-uniform and keeps the wgmma descriptors made from them in uniform registers (the
  // forward's consume_tile: 8-15 % fewer instructions). The backward shuffles only the wg its
  // descriptors take: uniform fields throughout reordered its D = 64 kernel, 2 % slower (H100).
  static __device__ __forceinline__ ConsumerThread warp_uniform(int consumer_tid) {
    ConsumerThread th(consumer_tid);
    th.wg = __shfl_sync(0xffffffffu, th.wg, 0);
    th.warp = __shfl_sync(0xffffffffu, th.warp, 0);
    return th;
  }
  // The first of the warpgroup's 64 rows, and this thread's first row, in a tile at m0.
  __device__ __forceinline__ int wg_row0(int m0) const { return m0 + 64 * wg; }
  __device__ __forceinline__ int row0(int m0) const { return m0 + 64 * wg + 16 * warp + g; }
  // This thread's rows (half 0, 1) within the CTA's tile.
  __device__ __forceinline__ int tile_row(int half) const {
    return 64 * wg + 16 * warp + g + 8 * half;
  }
  // Tells the producer this warp is done with a slot (every warp of every consumer arrives).
  __device__ __forceinline__ void release(uint64_t* bar) const {
    if (lane == 0) mbar_arrive(bar);
  }
};

// Element offsets of a thread's column pairs 8 t + 2 tq, +1 in one row of a SwizzledTile of
// ROWS rows (64-column panels): one base XOR-ed with the chunk t % 8 (rows start on 64
// elements, so the base's chunk bits are free), not an address per t held in registers.
template <int ROWS>
struct SwizzledPairs {
  int base;
  __device__ __forceinline__ SwizzledPairs(int row, int tq)
      : base(detail::SwizzledTile<ROWS, 64>::off(row, 2 * tq)) {}
  __device__ __forceinline__ int operator()(int t) const {
    return (base ^ ((t % 8) << 3)) + (t / 8) * (ROWS * 64);
  }
};

// Online softmax state of a thread's two rows: running max (of the accumulator units) and sum.
struct RowState {
  float m[2], l[2];
  __device__ __forceinline__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }
};

// The mask's bits of a thread's column pairs as keep masks of packed 16-bit pairs: keep(half,
// t) is 0xffff in the half-word of each key of pair t (row half `half`) the mask shows, 0 where
// it hides it. A tile row is 16 bytes of bits (key c of the block in bit c % 8 of byte c / 8, or
// one row broadcast over queries); pair 8 t + 2 tq, +1 is bits 8 (t % 4) + 2 tq, +1 of word
// t / 4. Shifting those bits to the most significant bit of their byte lets one byte permute
// with sign replication spread each over a half-word: one instruction a pair.
template <typename Tr>
struct PairKeep {
  static_assert(Tr::NTS == 16, "one 16-byte row of bits per row of the tile");
  const uint32_t* rows[2];  // the row of each row half (words read as they are needed: the
                            // consumers' registers are full while P V runs)
  __device__ __forceinline__ PairKeep(const uint8_t* tile, bool one_row, const ConsumerThread& th) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rows[half] = reinterpret_cast<const uint32_t*>(tile + (one_row ? 0 : 16 * th.tile_row(half)));
    }
  }
  // The keep masks of the four pairs t = 4 w .. 4 w + 3 of one row half.
  struct Word {
    uint32_t first, second;  // bit 2 tq (resp. 2 tq + 1) of each byte moved to its msb
    __device__ __forceinline__ uint32_t operator()(int t) const {
      const uint32_t j = t % 4;  // the pair's byte
      const uint32_t select = (8 | j) | (8 | j) << 4 | (12 | j) << 8 | (12 | j) << 12;
      uint32_t keep;
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(keep) : "r"(first), "r"(second), "r"(select));
      return keep;
    }
  };
  __device__ __forceinline__ Word word(int half, int w, int tq) const {
    const uint32_t bits = rows[half][w];
    return {bits << (7 - 2 * tq), bits << (6 - 2 * tq)};
  }
};

// s += bias / scale from a bias tile: BM x BN in swizzled 64-column panels, read by ldmatrix
// (one x4 holds the thread's pairs of two 8-column tiles in both of its rows), or one plain row
// broadcast over queries. With kMasked, keys the mask hides get a bias of -inf first, on the
// packed pairs (valid where no softcap follows and bias_mul > 0).
template <typename Tr, typename T, bool kMasked>
__device__ __forceinline__ void add_bias(float (&s)[Tr::BN / 2], const uint8_t* bias_tile,
                                         const PairKeep<Tr>* keep, const FwdParamsSm90& P,
                                         const ConsumerThread& th) {
  using E = detail::Elem<T>;
  const float mul = P.p.bias_mul;
  auto add = [&](int half, int t, uint32_t pair, const typename PairKeep<Tr>::Word& bits) {
    if constexpr (kMasked) {
      const uint32_t k = bits(t);
      pair = (pair & k) | (~k & E::kNegInfPair);
    }
    const float2 b = E::unpack_fast(pair);
    // fmaf: a separate product would be computed ahead of S, in 64 more registers
    s[4 * t + 2 * half] = fmaf(b.x, mul, s[4 * t + 2 * half]);
    s[4 * t + 2 * half + 1] = fmaf(b.y, mul, s[4 * t + 2 * half + 1]);
  };
  const bool one_row = P.bias_tiles.one_row;
  const uint32_t* row = reinterpret_cast<const uint32_t*>(bias_tile) + th.tq;
  const detail::FragAddr<Tr::BM, Tr::BN> frag(bias_tile, 64 * th.wg + 16 * th.warp + th.lane % 16,
                                              8 * (th.lane / 16));
#pragma unroll
  for (int w = 0; w < Tr::NTS / 4; ++w) {  // pairs t = 4 w .. 4 w + 3: one word of mask bits
    typename PairKeep<Tr>::Word bits[2];
    if constexpr (kMasked) bits[0] = keep->word(0, w, th.tq), bits[1] = keep->word(1, w, th.tq);
    if (one_row) {
#pragma unroll
      for (int t = 4 * w; t < 4 * w + 4; ++t) {
        add(0, t, row[4 * t], bits[0]);
        add(1, t, row[4 * t], bits[1]);
      }
    } else {
#pragma unroll
      for (int t = 4 * w; t < 4 * w + 4; t += 2) {
        uint32_t r[4];
        detail::ldsm_x4(r, frag(0, 8 * t));
        add(0, t, r[0], bits[0]);
        add(1, t, r[1], bits[1]);
        add(0, t + 1, r[2], bits[0]);
        add(1, t + 1, r[3], bits[1]);
      }
    }
  }
}

// -inf where the mask is false (a tile of its bits, as PairKeep reads it).
template <typename Tr>
__device__ __forceinline__ void apply_mask(float (&s)[Tr::BN / 2], const uint8_t* tile,
                                           const FwdParamsSm90& P, const ConsumerThread& th) {
  static_assert(Tr::NTS == 16, "one 16-byte row of bits per row of the tile");
  const bool one_row = P.mask_tiles.one_row;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint4 row = *reinterpret_cast<const uint4*>(tile + (one_row ? 0 : 16 * th.tile_row(half)));
    const uint32_t words[4] = {row.x >> (2 * th.tq), row.y >> (2 * th.tq), row.z >> (2 * th.tq),
                               row.w >> (2 * th.tq)};
#pragma unroll
    for (int t = 0; t < Tr::NTS; ++t) {
      const uint32_t pair = words[t / 4] >> (8 * (t % 4));
      if (!(pair & 1u)) s[4 * t + 2 * half] = -INFINITY;
      if (!(pair & 2u)) s[4 * t + 2 * half + 1] = -INFINITY;
    }
  }
}

// -inf for keys the lengths or the diagonal window hide from a row, the row's keys [lo, hi)
// given as offsets from this thread's first column (tested per element only in tiles that cross
// a boundary).
template <typename Tr>
__device__ __forceinline__ void hide_outside(float (&s)[Tr::BN / 2], int half, int lo, int hi) {
#pragma unroll
  for (int t = 0; t < Tr::NTS; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * t + e;
      if (col < lo || col >= hi) s[4 * t + 2 * half + e] = -INFINITY;
    }
  }
}

// -inf for keys the lengths or the position rule hide from a row, in tiles that cross a
// boundary of the rule's band (a sink's keys lie outside it).
template <typename Tr>
__device__ __forceinline__ void hide_out_of_bounds(float (&s)[Tr::BN / 2],
                                                   const FwdParamsSm90& P, const TileWork& w,
                                                   const ConsumerThread& th, int n) {
  const detail::PositionRule rule = head_rule<Tr>(P, w.hk);
  const detail::Band& band = rule.band;
  const int r0 = th.wg_row0(w.m0), n0 = n * Tr::BN;
  const bool crosses = r0 + 64 > w.lens.q_len || n0 + Tr::BN > w.lens.kv_len ||
                       n0 - (r0 + 63) < band.dmin || n0 + Tr::BN - 1 - r0 > band.dmax;
  if (!crosses) return;
  // Row i sees keys [lo, hi) and, in a block with sink keys, [sink_lo, sink_hi): as offsets
  // from this thread's first column n0 + 2 tq.
  const int c0 = n0 + 2 * th.tq;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = th.row0(w.m0) + 8 * half;
    const bool row_exists = i < w.lens.q_len;
    const int lo = max(0, i + band.dmin) - c0;
    const int hi = row_exists ? min(w.lens.kv_len, i + band.dmax + 1) - c0 : lo;
    if (Tr::kTable && n0 < rule.sink) {
      const int sink_lo = max(0, i + rule.outer.dmin) - c0;
      const int sink_hi =
          row_exists ? min(min(w.lens.kv_len, rule.sink), i + rule.outer.dmax + 1) - c0 : sink_lo;
#pragma unroll
      for (int t = 0; t < Tr::NTS; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * t + e;
          const bool seen = (col >= lo && col < hi) || (col >= sink_lo && col < sink_hi);
          if (!seen) s[4 * t + 2 * half + e] = -INFINITY;
        }
      }
    } else {
      hide_outside<Tr>(s, half, lo, hi);
    }
  }
}

// -inf where a key's segment id differs from its row's: blocks whose ids are not all one value
// (kTileIndexed, segments.cuh; rare in packed batches), ids read straight from memory. Rows and
// keys past the ends read the last id; the bounds test hides them.
template <typename Tr>
__device__ __forceinline__ void hide_other_segments(float (&s)[Tr::BN / 2], const FwdParams& p,
                                                    const TileWork& w, const ConsumerThread& th,
                                                    int n) {
  const int32_t* q_ids = detail::q_segment_row(p, w.b);
  const int32_t* kv_ids = detail::kv_segment_row(p, w.b);
  const int last_q = static_cast<int>(p.s.seqlen_q) - 1;
  const int last_k = static_cast<int>(p.s.seqlen_k) - 1;
  int row_id[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_id[half] = __ldg(q_ids + min(th.row0(w.m0) + 8 * half, last_q));
  }
  const int c0 = n * Tr::BN + 2 * th.tq;
#pragma unroll
  for (int t = 0; t < Tr::NTS; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key_id = __ldg(kv_ids + min(c0 + 8 * t + e, last_k));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (key_id != row_id[half]) s[4 * t + 2 * half + e] = -INFINITY;
      }
    }
  }
}

// The gate's alpha of a consumer thread's two rows in a tile (0 past the last row; gated
// kernels only).
struct GateRows {
  float alpha[2];
};
template <typename Tr>
__device__ __forceinline__ GateRows gate_rows(const FwdParamsSm90& P, const TileWork& w,
                                              const ConsumerThread& th) {
  GateRows rows{};
  if constexpr (Tr::kGate) {
    const AttentionShape& s = P.p.s;
    const float* alpha = P.p.alpha + s.alpha_offset(w.b, w.h);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = th.row0(w.m0) + 8 * half;
      rows.alpha[half] =
          i < s.seqlen_q ? __ldg(alpha + static_cast<int64_t>(i) * s.num_heads) : 0.f;
    }
  }
  return rows;
}

// The gate's delta of the block in K / V ring slot kv (full once its V is).
template <typename Tr>
__device__ __forceinline__ const float* gate_delta(const uint8_t* smem,
                                                   const RingPos<Tr::kStages>& kv) {
  return reinterpret_cast<const float*>(smem + Tr::kOffDelta + kv.slot * Tr::kDeltaBytes);
}

// The gate, factored (gate.cuh; gated kernels take no softcap: HopperForwardTakes): s += min(x, 0)
// / scale with x = alpha_i delta_j, delta of the block's keys from its ring slot (a float2 a column
// pair); the softmax then weighs the exponentials by GateWeights.
template <typename Tr>
__device__ __forceinline__ void add_gate_bound(float (&s)[Tr::BN / 2], const float* delta,
                                               const GateRows& rows, const ConsumerThread& th,
                                               float mul) {
#pragma unroll
  for (int t = 0; t < Tr::NTS; ++t) {
    const float2 d = *reinterpret_cast<const float2*>(delta + 8 * t + 2 * th.tq);
    const float dx = d.x * mul, dy = d.y * mul;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      s[4 * t + 2 * half] += detail::gate_bound(rows.alpha[half] * dx);
      s[4 * t + 2 * half + 1] += detail::gate_bound(rows.alpha[half] * dy);
    }
  }
}

// The probabilities' factors (online_softmax): none, or the gate's sigmoid(|alpha_i delta_j|) with
// delta of the block's keys in its ring slot.
struct NoWeights {
  static constexpr bool kAny = false;
};
struct GateWeights {
  static constexpr bool kAny = true;
  const float* delta;
  float half_alpha[2];  // alpha / 2 of the thread's two rows
  int tq;
  // Element i of column pair tile t: row half i / 2, column 8 t + 2 tq + i % 2.
  __device__ __forceinline__ float operator()(int t, int i) const {
    return detail::gate_weight(half_alpha[i / 2] * delta[8 * t + 2 * tq + i % 2]);
  }
};
template <typename Tr>
__device__ __forceinline__ auto probability_weights(const uint8_t* smem,
                                                    const RingPos<Tr::kStages>& kv,
                                                    const GateRows& gate,
                                                    const ConsumerThread& th) {
  if constexpr (Tr::kGate) {
    return GateWeights{gate_delta<Tr>(smem, kv), {0.5f * gate.alpha[0], 0.5f * gate.alpha[1]},
                       th.tq};
  } else {
    return NoWeights{};
  }
}

// S(n), in accumulator units (q . k), to the scores the softmax takes: + bias / scale, + the
// gate's bound (gated kernels take no softcap), softcap, then -inf where the mask, the segment
// ids, the lengths or the diagonal window hide a key. The bias and mask tiles come from their
// rings, released here; the gate's delta from block n's K / V slot `kv`, once its V is full.
template <typename Tr, typename T>
__device__ __forceinline__ void finish_scores(float (&s)[Tr::BN / 2], const FwdParamsSm90& P,
                                              const uint8_t* smem, const FwdBarriers<Tr>& bar,
                                              OperandRings<Tr>& operands, const TileWork& w,
                                              const ConsumerThread& th, int n, int flags,
                                              const RingPos<Tr::kStages>& kv,
                                              const GateRows& gate) {
  const FwdParams& p = P.p;
  bool mask_pending = Tr::kOperands && loads_mask(p, flags);
  if constexpr (Tr::kBias) {
    if (p.bias != nullptr) {
      RingPos<Tr::kBiasStages>& pos = operands.bias;
      mbar_wait(bar.bias_full(pos.slot), pos.parity);
      const uint8_t* tile = smem + Tr::kOffBias + pos.slot * Tr::kBiasBytes;
      if (mask_pending && p.softcap == 0.f && p.bias_mul > 0.f) {  // the mask rides on the bias
        RingPos<Tr::kMaskStages>& mpos = operands.mask;
        mbar_wait(bar.mask_full(mpos.slot), mpos.parity);
        const PairKeep<Tr> keep(smem + Tr::kOffMask + mpos.slot * Tr::kMaskBytes,
                                P.mask_tiles.one_row, th);
        add_bias<Tr, T, true>(s, tile, &keep, P, th);
        th.release(bar.mask_empty(mpos.slot));
        mpos.advance();
        mask_pending = false;
      } else {
        add_bias<Tr, T, false>(s, tile, nullptr, P, th);
      }
      th.release(bar.bias_empty(pos.slot));
      pos.advance();
    }
  }
  if constexpr (Tr::kGate) {
    mbar_wait(bar.v_full(kv.slot), kv.parity);
    add_gate_bound<Tr>(s, gate_delta<Tr>(smem, kv), gate, th, p.bias_mul);
  }
  if (!Tr::kGate && p.softcap > 0.f) {
#pragma unroll
    for (int i = 0; i < Tr::BN / 2; ++i) {
      s[i] = p.softcap * detail::accurate_tanh(s[i] * p.softcap_in);
    }
  }
  if constexpr (Tr::kOperands) {
    if (mask_pending) {
      RingPos<Tr::kMaskStages>& pos = operands.mask;
      mbar_wait(bar.mask_full(pos.slot), pos.parity);
      apply_mask<Tr>(s, smem + Tr::kOffMask + pos.slot * Tr::kMaskBytes, P, th);
      th.release(bar.mask_empty(pos.slot));
      pos.advance();
    }
  }
  if constexpr (Tr::kSegments) {
    if (flags & detail::kTileIndexed) hide_other_segments<Tr>(s, p, w, th, n);
  }
  hide_out_of_bounds<Tr>(s, P, w, th, n);
}

// s <- exp2(s * mul - m) weigh(element) with the rows' new maxima; corr: the factor for what was
// summed before.
// kTrackGrowth: corr is exactly 1 for a row whose maximum held, and the result says whether the
// warp has a row whose maximum grew (the only rows whose O needs the factor); without, true.
// kChains: the independent chains each row's maximum and sum are reduced in; with more than
// one, the thread's two rows also go through each step side by side (kSoftmaxChains).
template <bool kTrackGrowth, int kChains, int N, typename Weights = NoWeights>
__device__ __forceinline__ bool online_softmax(float (&s)[N], RowState& st, float (&corr)[2],
                                               float mul, const Weights& weigh = {}) {
  static_assert((N / 4) % kChains == 0, "whole chains of column pairs");
  // This thread's maximum of row half `half`, with the running maximum.
  auto thread_max = [&](int half) {
    float part[kChains];
#pragma unroll
    for (int t = 0; t < N / 4; ++t) {
      const float pair = fmaxf(s[4 * t + 2 * half], s[4 * t + 2 * half + 1]);
      part[t % kChains] = t < kChains ? pair : fmaxf(part[t % kChains], pair);
    }
    float mx = st.m[half];
#pragma unroll
    for (int c = 0; c < kChains; ++c) mx = fmaxf(mx, part[c]);
    return mx;
  };
  // The row's maximum over its four threads.
  auto quad_max = [](float mx, int lanes) {
    return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, lanes));
  };
  bool grew = false;
  float m_scaled[2];
  auto take_max = [&](int half, float mx) {
    m_scaled[half] = mx == -INFINITY ? 0.f : mx * mul;
    corr[half] = detail::fast_exp2(st.m[half] * mul - m_scaled[half]);
    if constexpr (kTrackGrowth) {
      grew = grew || mx != st.m[half];
      if (mx == st.m[half]) corr[half] = 1.f;
    }
    st.m[half] = mx;
  };
  // Element i of column pair tile t (row half i / 2) to its probability, summed into `sums`.
  auto to_probability = [&](int t, int i, float (&sums)[kChains]) {
    float& x = s[4 * t + i];
    x = detail::fast_exp2(x * mul - m_scaled[i / 2]);
    if constexpr (Weights::kAny) x *= weigh(t, i);
    sums[(2 * t + i % 2) % kChains] += x;
  };
  auto take_sum = [&](int half, const float (&sums)[kChains]) {
    float sum = sums[0];
#pragma unroll
    for (int c = 1; c < kChains; ++c) sum += sums[c];
    st.l[half] = st.l[half] * corr[half] + sum;
  };
  if constexpr (kChains == 1) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      take_max(half, quad_max(quad_max(thread_max(half), 1), 2));
      float sums[1] = {0.f};
#pragma unroll
      for (int t = 0; t < N / 4; ++t) {
        to_probability(t, 2 * half, sums);
        to_probability(t, 2 * half + 1, sums);
      }
      take_sum(half, sums);
    }
  } else {
    float mx[2] = {thread_max(0), thread_max(1)};
#pragma unroll
    for (int lanes = 1; lanes <= 2; lanes *= 2) {
      mx[0] = quad_max(mx[0], lanes);
      mx[1] = quad_max(mx[1], lanes);
    }
    take_max(0, mx[0]);
    take_max(1, mx[1]);
    float sums[2][kChains] = {};
#pragma unroll
    for (int t = 0; t < N / 4; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) to_probability(t, i, sums[i / 2]);
    }
    take_sum(0, sums[0]);
    take_sum(1, sums[1]);
  }
  return kTrackGrowth ? __any_sync(0xffffffffu, grew) : true;
}

template <int N>
__device__ __forceinline__ void rescale(float (&o)[N], const float (&corr)[2]) {
#pragma unroll
  for (int t = 0; t < N / 4; ++t) {
    o[4 * t] *= corr[0];
    o[4 * t + 1] *= corr[0];
    o[4 * t + 2] *= corr[1];
    o[4 * t + 3] *= corr[1];
  }
}

// The probabilities as the A fragments of the P V wgmma (k-step kk: columns 16 kk ..).
template <typename T, int N>
__device__ __forceinline__ void pack_probabilities(uint32_t (&a)[N / 8][4], const float (&s)[N]) {
  using E = detail::Elem<T>;
#pragma unroll
  for (int kk = 0; kk < N / 8; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[kk][j] = E::pack(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
  }
}

}  // namespace dmattn::cuda::sm90
