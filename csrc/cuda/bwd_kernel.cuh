// Backward kernels.
//
//   bwd_preprocess:  softmax_d = rowsum(dout * out) - dlse                  (one warp per row)
//   bwd_zero_dbias:  zeros of a full-size dbias where bwd_kernel computes nothing (no memset)
//   bwd_kernel:      one CTA per (key block, kv head, dk/dv slot class). K and V of the block
//                    stay in shared memory; the CTA walks every (batch, query head) pair that
//                    reads this kv slot (the GQA group and the batches dk/dv broadcast over) and
//                    every visible query block of each, so dK/dV accumulate in registers with no
//                    cross-CTA reduction. Key blocks run heaviest first (block_order.cuh)
//                    under a mask that varies over queries and keys. Per query block
//                    (all-false mask tiles skipped):
//                      load     Q, dO, lse, D, bias of the next block (two stages: during this
//                               one; one stage: during phase C), its mask tile during this one
//                      phase A  S^T = K Q^T + bias^T/scale -> mask -> P = exp(S - lse) -> smem,
//                               dP^T = V dO^T -> dS = P (dP - D) -> smem (and dbias)
//                      phase B  dV += P^T dO, dK += dS^T Q
//                      phase C  dQ += dS K   (fp32 atomics into the accumulator)
//   bwd_dq_convert:  dq = scale * accumulator in the output dtype
//   dbias_convert:   dbias = fp32 workspace in the output dtype (atomic dbias mode only)
//
// On sm_90a the GEMMs run on wgmma when every phase's warps stand in warpgroups of four 16-row
// slices (kWgmma); the accumulators have the mma.sync layout either way. Where a warp's phase A
// tile is its phase B A operand (kRegFrags), P and dS stay in registers and phase B's GEMMs are
// issued as soon as P, then dS, exist; dQ goes through a shared-memory stage and leaves with one
// bulk reduction per block (StagedDq).
//
// Index masks (kIndex: segment ids, key / row ranges, block indices): the walk over query
// blocks also skips the blocks they hide, and blocks they leave partly visible test each score
// (index_masks.cuh). Window tables (kTable): each key block's query range is that of its kv
// head's band, or with sink keys in the block, of the call's band; with sinks the CTAs run
// rank-major (BwdParams::ranks_outer), every kv head's sink blocks first.
//
// Gated calls (gate.cuh) run kernels of their own (kGatedForms, the forms' code too): the gate's
// term joins S^T after its GEMM, the walk passes over the grid blocks its threshold drops, and
// its gradients are summed from each block's dS tile once it is in shared memory
// (add_gate_grads: computed beside the S^T and dP^T fragments, they doubled the spills).
//
// dbias: full-size bias -> dS tiles stored directly; bias broadcast over queries -> per-key sums
// kept in registers over the CTA's query blocks (and over the query heads that share the entry),
// stored once; shapes whose entries are shared between CTAs -> fp32 atomics into a workspace.
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

// Shared-memory opt-in limit of sm_80 (A100): 163 KB per block. Tiles above it are sm_90-only.
constexpr int kSmemLimitSm80 = 163 * 1024;
constexpr int kSmemLimitSm90 = 227 * 1024;
// Threads of a bwd_zero_dbias CTA.
constexpr int kZeroThreads = 256;

// Backward tile: key block BN, query block BM, NW warps, and the warp grid of each phase:
//   phase A  (S^T, dP^T: keys x queries)  WKA warps along keys   x NW / WKA along queries
//   phase B  (dV, dK:    keys x D)        WKB warps along keys   x NW / WKB along D
//   phase C  (dQ:        queries x D)     WMC warps along queries x NW / WMC along D
// kStages: Q / dO / lse / D / bias buffers (2: the next query block loads during the current
// one; 1: it loads during phase C). With one stage, the bias tile shares memory with P when the
// tile would otherwise not fit sm_80's 163 KB. kAllowWgmma = false keeps mma.sync on sm_90a.
template <int D_, int BN_, int BM_, int NW_, int WKA_, int WKB_, int WMC_, int kStages_,
          bool kAllowWgmma = true>
struct BwdTraits {
  static constexpr int D = D_, BN = BN_, BM = BM_, NW = NW_;
  static constexpr int kNT = NW * 32;
  // (8-warp CTAs need more than 128 registers per thread: one CTA per SM.)
  static constexpr int kMinBlocks = 1;
  static constexpr int kStages = kStages_;
  static_assert(kStages == 1 || kStages == 2, "one or two Q/dO stages");

  static constexpr int WKA = WKA_, WKB = WKB_, WMC = WMC_;
  static_assert(NW % WKA == 0 && NW % WKB == 0 && NW % WMC == 0, "warp grids tile the CTA");
  // phase A: warp tile KA keys x QA queries = MA x NA mma tiles of 16 x 8
  static constexpr int KA = BN / WKA, MA = KA / 16;
  static constexpr int QA = BM / (NW / WKA), NA = QA / 8;
  static_assert(KA % 16 == 0 && QA % 16 == 0, "phase A warp tile");
  // S^T and dP^T in one k-loop (enough independent MMAs per warp with a single key tile) or one
  // after the other (two key tiles: fewer live registers, still 8 accumulator chains each).
  static constexpr bool kFusedA = MA == 1;
  // phase B: warp tile KB keys x DB head-dim columns
  static constexpr int KB = BN / WKB, MB = KB / 16;
  static constexpr int DB = D / (NW / WKB);
  static_assert(KB % 16 == 0 && DB % 16 == 0 && DB * (NW / WKB) == D, "phase B warp tile");
  // phase C: warp tile QC queries x DC head-dim columns, accumulated CH columns at a time
  static constexpr int QC = BM / WMC, MC = QC / 16;
  static constexpr int DC = D / (NW / WMC);
  static constexpr int CH = DC <= 64 ? DC : (DC % 64 == 0 ? 64 : DC / 2);
  static_assert(QC % 16 == 0 && DC * (NW / WMC) == D && DC % CH == 0 && CH % 16 == 0,
                "phase C warp tile");
  // wgmma: in every phase a warpgroup (4 consecutive warps) stacks four 16-row warp tiles along
  // M (keys in A and B, queries in C), and its N (QA, DB, CH; DC in chunks of CH) is a wgmma
  // width.
  static constexpr bool kWgmmaShape = NW == 8 && KA == 16 && WKA % 4 == 0 && KB == 16 &&
                                      WKB % 4 == 0 && QC == 16 && WMC == 4 && DC % CH == 0 &&
                                      D % 64 == 0 && BM == 64 &&
                                      (QA == 32 || QA == 64) &&
                                      (DB == 32 || DB == 64 || DB == 128) &&
                                      (CH == 32 || CH == 64 || CH == 128);
#if defined(DMATTN_WGMMA)
  static constexpr bool kWgmma = kAllowWgmma && kWgmmaShape;
#else
  static constexpr bool kWgmma = false;
#endif

  // A warp's phase A tile (16 keys x every query of the block) is the A operand of its phase B
  // GEMMs: P and dS stay in registers for dV and dK (no P tile; on sm_90a the GEMMs start as
  // soon as their operand is computed).
  static constexpr bool kRegFrags = KA == 16 && KB == 16 && WKA == WKB && QA == BM;

  static constexpr int kBiasPitch = BN + 8;   // elements
  static constexpr int kMaskPitch = BN + 16;  // bytes
  static constexpr int kQBytes = BM * D * 2;
  static constexpr int kBiasBytes = BM * kBiasPitch * 2;
  static constexpr int kBiasRowBytes = kBiasPitch * 2;  // a bias broadcast over queries
  static constexpr int kPBytes = BN * BM * 2;  // P or dS
  static constexpr int kPTileBytes = kRegFrags ? 0 : kPBytes;
  static constexpr int kMaskTile = BM * kMaskPitch;
  // wgmma tiles (sm_90a code only) stage a block's dQ in shared memory and add it to the
  // accumulator with one bulk reduction: the accumulator has the stage's layout (StagedDq).
  static constexpr bool kDqStaged = kAllowWgmma && kWgmmaShape;
  static constexpr int kDqBytes = kDqStaged ? BM * D * 4 : 0;
  static constexpr int kFixedBytes = 2 * BN * D * 2 + 2 * kStages * kQBytes + kPBytes +
                                     kPTileBytes + 2 * kMaskTile + 2 * kStages * BM * 4 + BN * 4 +
                                     kDqBytes;
  static constexpr bool kAliasBiasP =
      kStages == 1 && !kRegFrags && kFixedBytes + kStages * kBiasBytes > kSmemLimitSm80;

  // Layout: the tiles every call uses, then the mask tiles, then the bias tiles (unless they
  // share memory with P), so that a call without them launches with less (SmemBytes).
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + BN * D * 2;
  static constexpr int kOffQ = kOffV + BN * D * 2;          // kStages tiles
  static constexpr int kOffdO = kOffQ + kStages * kQBytes;  // kStages tiles
  static constexpr int kOffdS = kOffdO + kStages * kQBytes;
  static constexpr int kOffP = kOffdS + kPBytes;
  static constexpr int kOffLse =
      kOffP + (kAliasBiasP && kBiasBytes > kPBytes ? kBiasBytes : kPTileBytes);
  static constexpr int kOffDsum = kOffLse + kStages * BM * 4;  // kStages x BM floats each
  static constexpr int kOffDB = kOffDsum + kStages * BM * 4;
  static constexpr int kOffPair = kOffDB + BN * 4;  // detail::BwdPair
  static constexpr int kOffDq = kOffPair + 64;
  static constexpr int kOffMask = kOffDq + kDqBytes;  // 2 tiles
  static constexpr int kOffBias = kAliasBiasP ? kOffP : kOffMask + 2 * kMaskTile;  // kStages
  static constexpr int SmemBytes(bool mask, bool bias, bool bias_one_row) {
    if (bias && !kAliasBiasP) {
      return kOffBias + kStages * (bias_one_row ? kBiasRowBytes : kBiasBytes);
    }
    return mask ? kOffMask + 2 * kMaskTile : kOffMask;
  }
  static constexpr int kSmem = SmemBytes(true, true, false);
  // Tiles whose full-bias layout exceeds sm_90's 227 KB serve only calls without a per-query
  // bias (for the rest, PrepareSmem returns the CUDA error).
  static constexpr bool kFitsQueryBias = kSmem <= kSmemLimitSm90;
  static_assert(kBiasBytes % 16 == 0 && kMaskTile % 16 == 0, "16-byte aligned tiles");
  static_assert((BN * D * 2) % 128 == 0 && kQBytes % 128 == 0 && kPBytes % 128 == 0,
                "swizzled tiles start on 128-byte boundaries (FragAddr)");
  static_assert(!kWgmma || ((BN * D * 2) % 1024 == 0 && kQBytes % 1024 == 0 &&
                            kPBytes % 1024 == 0 && kOffP % 1024 == 0),
                "wgmma operands start on 1024-byte boundaries");
  static_assert(kOffDq % 16 == 0 && SmemBytes(true, true, true) <= kSmemLimitSm90,
                "dQ stage alignment, sm_90 capacity");
  // FragAddr folding: the phase B / C column offsets are multiples of a power of two above the
  // columns each warp walks.
  static constexpr bool kFoldB = (DB & (DB - 1)) == 0;
  static constexpr bool kFoldC = (DC & (DC - 1)) == 0 && (QC & (QC - 1)) == 0;
  static constexpr bool kOffHopper = false;
};

// A tile of a head dim whose sm_90a tiles replace it on Hopper (launch_template.cuh): its
// kernels are left out of sm_90a code (a trap; the D = 128 unit compiled in 74 s, 129 before).
template <typename Tr>
struct OffHopper : Tr {
  static constexpr bool kOffHopper = true;
};

// The dq accumulator of wgmma tiles: [batch, H, Lq, D] fp32, the 16-byte chunks of row i XOR-ed
// with 2 (i % 4), so that one query block of one head is contiguous (one bulk reduction from the
// shared-memory stage, which has the same layout) and the stage's 8-byte fragment stores are
// free of bank conflicts (a half warp: rows i..i+3, two chunks each, eight distinct chunks; with
// i % 8 two rows shared a chunk). Other tiles accumulate in q's layout [batch, Lq, H, D].
struct StagedDq {
  __host__ __device__ static int64_t row(const AttentionShape& s, int64_t b, int64_t h) {
    return (b * s.num_heads + h) * s.seqlen_q;  // first row of (b, h)
  }
  // Where column c of row i is stored within the row (only i % 4 matters).
  __host__ __device__ static int column(int i, int c) {
    return ((((c >> 2) ^ (i << 1)) & 7) | ((c >> 2) & ~7)) * 4 + (c & 3);
  }
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

// Pointers of the current (batch, query head) pair: kept in shared memory, not in registers
// (the main loop is register-bound).
struct BwdPair {
  const void* q;
  const void* dout;
  const float* lse;
  const float* dsum;
  const uint8_t* mask;
  const void* bias;
  float* dq;
  int64_t dbias_entry;
};
static_assert(sizeof(BwdPair) == 64, "BwdPair fills its 64-byte slot");

// The work of backward CTA `bid`: a key block of one (kv head, dk/dv class) segment. Segments
// are the slow index, or with ranks_outer the fast one; a segment's key blocks go by rank, in
// block_order's order where there is one. (Only calls with a window table set ranks_outer: they
// run the kTable kernels.)
struct BwdCta {
  int n_block;
  int hk;
  int64_t cls;
};

template <bool kTable>
__device__ __forceinline__ BwdCta bwd_cta(const BwdParams& p, int64_t bid) {
  const int Hk = static_cast<int>(p.s.num_kv_heads);
  if (kTable && p.ranks_outer) {
    const int64_t segment = bid % (Hk * p.kv_classes);
    const int rank = static_cast<int>(bid / (Hk * p.kv_classes));
    return {p.block_order ? p.block_order[segment * p.n_blocks + rank] : rank,
            static_cast<int>(segment % Hk), segment / Hk};
  }
  return {p.block_order ? p.block_order[bid] : static_cast<int>(bid % p.n_blocks),
          static_cast<int>((bid / p.n_blocks) % Hk), bid / p.n_blocks / Hk};
}

// Query blocks [*m_first, *m_last] (empty: last < first) of BM rows that see any key of the BN
// keys from n0, from lengths and the position rule alone. The rows that see the block's sink
// keys (under the call's band, which contains the rule's band) and those that see its keys by
// the band overlap, so one range holds both.
template <int BM, int BN, bool kSinks = true>
__device__ __forceinline__ void query_blocks_seeing(int n0, const SeqLens& L,
                                                    const PositionRule& rule, int* m_first,
                                                    int* m_last) {
  *m_first = 0;
  *m_last = -1;
  if (n0 >= L.kv_len || L.q_len <= 0) return;
  const int j_last = min(n0 + BN, L.kv_len) - 1;
  int64_t i_min = static_cast<int64_t>(n0) - rule.band.dmax;      // j <= i + dmax
  int64_t i_max = static_cast<int64_t>(j_last) - rule.band.dmin;  // j >= i + dmin
  if (kSinks && n0 < rule.sink) {  // and the rows that see the block's sink keys
    i_min = min(i_min, static_cast<int64_t>(n0) - rule.outer.dmax);
    i_max = max(i_max, static_cast<int64_t>(min(j_last, rule.sink - 1)) - rule.outer.dmin);
  }
  i_min = i_min < 0 ? 0 : i_min;
  i_max = i_max > L.q_len - 1 ? L.q_len - 1 : i_max;
  if (i_max >= i_min) {
    *m_first = static_cast<int>(i_min / BM);
    *m_last = static_cast<int>(i_max / BM);
  }
}

// Whether every row of the BM-row query block at m0 exists and sees, of the BN keys from n0,
// exactly the sink's: none by the rule's band, all of them by the call's band. Most of a sink
// block's query blocks are such tiles; the backward tests them by column alone.
template <int BM, int BN>
__device__ __forceinline__ bool sees_sink_keys_only(const PositionRule& rule, const SeqLens& L,
                                                    int m0, int n0) {
  const int64_t d_lo = static_cast<int64_t>(n0) - (m0 + BM - 1);  // j - i over the tile
  const int64_t d_hi = static_cast<int64_t>(n0) + BN - 1 - m0;
  return m0 + BM <= L.q_len && (d_hi < rule.band.dmin || d_lo > rule.band.dmax) &&
         d_lo >= rule.outer.dmin && d_hi <= rule.outer.dmax;
}

template <typename Tr, typename T, bool kBias, int kIndex, bool kTable>
__device__ __forceinline__ void bwd_main(const BwdParams& p) {
  using E = Elem<T>;
  constexpr int D = Tr::D, BM = Tr::BM, BN = Tr::BN, NT = Tr::kNT;
  constexpr int MA = Tr::MA, NA = Tr::NA, MB = Tr::MB, DB = Tr::DB;
  constexpr int MC = Tr::MC, DC = Tr::DC, CH = Tr::CH;
  constexpr int kStages = Tr::kStages;
  using TileKV = SwizzledTile<BN, D>;
  using TileP = SwizzledTile<BN, BM>;
  constexpr int kFragSteps = Tr::kRegFrags ? BM / 16 : 1;
  // sm_90a with register fragments: phase B's GEMMs start inside phase A.
  constexpr bool kEarlyB = Tr::kWgmma && Tr::kRegFrags;
  constexpr bool kIndexed = kIndex != kNoIndex;

  static_assert((BN + kStages * BM) * 4 <= kSegmentSmem, "the ids fit the segment prefix");
  extern __shared__ __align__(128) uint8_t smem_base[];
  uint8_t* smem = smem_base + IndexPrefixSmem(kIndex);
  // Segment ids: the kv ids of the key block (this pair's batch entry), the q ids of each stage;
  // the gate's delta and alpha likewise
  int32_t* sKeyIds = reinterpret_cast<int32_t*>(smem_base);
  int32_t* sRowIds = sKeyIds + BN;
  float* sKeyDelta = reinterpret_cast<float*>(smem_base + kSegmentSmem);
  float* sRowAlpha = sKeyDelta + BN;
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
  float* sDq = reinterpret_cast<float*>(smem + Tr::kOffDq);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const AttentionShape& s = p.s;

  const int G = static_cast<int>(s.num_heads / s.num_kv_heads);
  const BwdCta cta = bwd_cta<kTable>(p, blockIdx.x);
  const int n_block = cta.n_block, hk = cta.hk;
  const int64_t cls = cta.cls;
  const int n0 = n_block * BN;
  const int Lk = static_cast<int>(s.seqlen_k);
  const PositionRule rule = position_rule_of<kTable>(p, hk);
  const Band& band = rule.band;

  const int64_t q_rs = s.q_row_stride();
  const int64_t kv_rs = s.kv_row_stride();
  const int64_t b_rep = batch_of(p, cls, 0);
  const T* kg = static_cast<const T*>(p.k) + s.kv_offset(b_rep, hk) + n0 * kv_rs;
  const T* vg = static_cast<const T*>(p.v) + s.kv_offset(b_rep, hk) + n0 * kv_rs;

  const bool has_mask = p.mask != nullptr;
  const bool has_segments = has_segment_ids<kIndex>(p);
  constexpr bool has_bias = kBias;  // p.bias != nullptr
  const bool mask_one_row = s.mask.row_stride == 0;
  const bool bias_one_row = s.bias.row_stride == 0;
  const int dbias_mode = kBias ? p.dbias_mode : kDbiasNone;
  const BroadcastOperand& dop = p.dbias_op;
  const bool db_rowsum = dbias_mode != kDbiasNone && dop.row_stride == 0;
  const bool db_colsum = dbias_mode != kDbiasNone && dop.row_stride != 0 && dop.col_stride == 0;
  // p.dbias_staged: dbias tiles leave through the bias tile of their block (free once phase A
  // has read it; not where P shares its memory) in 16-byte chunks instead of 2-byte stores.
  const bool db_staged = !Tr::kAliasBiasP && p.dbias_staged;
  const int bias_stage = (bias_one_row ? Tr::kBiasRowBytes : Tr::kBiasBytes) / 2;  // elements

  // Warp tiles of the three phases (local key / query / head-dim offsets).
  const int ka0 = (warp % Tr::WKA) * Tr::KA;  // phase A keys
  const int qa0 = (warp / Tr::WKA) * Tr::QA;  // phase A queries
  const int kb0 = (warp % Tr::WKB) * Tr::KB;  // phase B keys
  const int db0 = (warp / Tr::WKB) * DB;      // phase B head-dim columns
  const int qc0 = (warp % Tr::WMC) * Tr::QC;  // phase C queries
  const int dc0 = (warp / Tr::WMC) * DC;      // phase C head-dim columns
  // Element e of mma tile (mt, t) of phase A's warp tile: its local key and query; a pair
  // (e = 2 h, 2 h + 1) shares the key and sits at pair_offset in the P / dS tiles.
  auto key_of = [&](int mt, int e) { return ka0 + mt * 16 + g + (e >> 1) * 8; };
  auto query_of = [&](int t, int e) { return qa0 + t * 8 + 2 * tq + (e & 1); };
  auto pair_offset = [&](int mt, int t, int h) {
    return TileP::off(key_of(mt, 2 * h), query_of(t, 0));
  };
  auto element_bit = [](int mt, int t, int e) { return (mt * NA + t) * 4 + e; };
  // The [query][key] tile row (pitch kBiasPitch) that this lane addresses in an ldmatrix /
  // stmatrix .trans of the four 8 x 8 blocks (queries 8 t', keys 16 mt + 8 h), t' = t, t + 1,
  // h = 0, 1, of phase A's tiles (mt, t) and (mt, t + 1).
  const int blk = lane >> 3;
  auto transposed_row = [&](int mt, int t) {
    return (qa0 + (t + (blk >> 1)) * 8 + (lane & 7)) * Tr::kBiasPitch + ka0 + mt * 16 +
           (blk & 1) * 8;
  };
  static_assert(MA * NA * 4 <= 32, "one visibility bit per element of a phase A warp tile");

  // ldmatrix addressing (see FragAddr): A operands (rows = M dim) use row lane part
  // (lane & 7) + ((lane >> 3) & 1) * 8 and column lane part (lane >> 4) * 8; non-transposed B
  // operands (rows = N dim) use (lane & 7) + (lane >> 4) * 8 and ((lane >> 3) & 1) * 8.
  // Q / dO addresses are those of stage 0; `so` adds the stage's byte offset.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;
  const FragAddr<BN, D> fkA(sK, ka0 + a_row, a_col), fvA(sV, ka0 + a_row, a_col);
  const FragAddr<BM, D> fqA(sQ, qa0 + b_row, b_col), foA(sdO, qa0 + b_row, b_col);
  const FragAddr<BN, BM> fpB(sP, kb0 + a_row, a_col), fdsB(sdS, kb0 + a_row, a_col);
  const FragAddr<BM, D, Tr::kFoldB> foB(sdO, a_row, a_col, db0), fqB(sQ, a_row, a_col, db0);
  const FragAddr<BN, BM, Tr::kFoldC> fdsC(sdS, b_row, b_col, qc0);
  const FragAddr<BN, D, Tr::kFoldC> fkC(sK, a_row, a_col, dc0);

  // K, V of this block (rows beyond the longest kv length are zero-filled; the per-pair lengths
  // are applied by visibility).
  load_tile_async<BN, D, NT>(sK, kg, kv_rs, Lk - n0, tid);
  load_tile_async<BN, D, NT>(sV, vg, kv_rs, Lk - n0, tid);
  cp_async_commit();
  if (tid < BN) sDB[tid] = 0.f;

  float dk[MB][DB / 8][4], dv[MB][DB / 8][4];
#pragma unroll
  for (int mt = 0; mt < MB; ++mt)
#pragma unroll
    for (int t = 0; t < DB / 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dk[mt][t][e] = 0.f;
        dv[mt][t][e] = 0.f;
      }
  // per-key dbias sums (keys ka0 + 16 mt + g, + 8) of this thread
  float db_acc[MA][2];
#pragma unroll
  for (int mt = 0; mt < MA; ++mt) db_acc[mt][0] = db_acc[mt][1] = 0.f;
  bool db_dirty = false;
  // The gate (kGatedForms kernels): alpha and delta staged with the ids.
  static_assert(kGateBlockQ % BM == 0 && kGateBlockK % BN == 0, "tiles nest in the gate grid");
  constexpr bool kGated = kIndex == kGatedForms;

  int stage = 0;  // Q / dO stage of the current query block (kept across pairs)
  // wgmma tiles: the staged dQ block waiting for its bulk reduction, which thread 0 issues after
  // the barrier that follows the stage's writes (and their proxy fences).
  float* dq_dst = nullptr;
  int dq_bytes = 0;
  auto reduce_staged_dq = [&] {
    if (tid == 0 && dq_bytes > 0) {
      bulk_reduce_add(dq_dst, sDq, dq_bytes);
      bulk_commit();
    }
    dq_bytes = 0;
  };
  const int64_t pairs = p.kv_members * G;
  for (int64_t pi = 0; pi < pairs; ++pi) {
    const int64_t b = batch_of(p, cls, pi / G);
    const int h = hk * G + static_cast<int>(pi % G);
    const SeqLens L = seq_lens(s, p.q_lens, p.kv_lens, b);
    __syncthreads();  // the previous pair's pointers are no longer read
    if (tid == 0) {
      BwdPair& w = *reinterpret_cast<BwdPair*>(smem + Tr::kOffPair);
      w.q = static_cast<const T*>(p.q) + s.q_offset(b, h);
      w.dout = static_cast<const T*>(p.dout) + s.q_offset(b, h);
      w.lse = p.lse + s.lse_offset(b, h);
      w.dsum = p.softmax_d + s.lse_offset(b, h);
      w.mask = has_mask ? p.mask + s.mask.offset(s.batch, b, h) + n0 * s.mask.col_stride : nullptr;
      w.bias = has_bias ? static_cast<const T*>(p.bias) + s.bias.offset(s.batch, b, h) +
                              n0 * s.bias.col_stride
                        : nullptr;
      w.dq = !p.compute_dq ? nullptr
             : p.dq_accum + (Tr::kDqStaged ? StagedDq::row(s, b, h) * D : s.q_offset(b, h));
      w.dbias_entry = dbias_mode != kDbiasNone ? dop.offset(s.batch, b, h) : 0;
    }
    __syncthreads();
    const BwdPair& pp = *reinterpret_cast<const BwdPair*>(smem + Tr::kOffPair);
    // made where it is read: kept across the blocks, its fields took registers
    auto gate = [&] { return GateView(p, b, h); };
    int m_first, m_last;
    query_blocks_seeing<BM, BN, kTable>(n0, L, rule, &m_first, &m_last);

    auto load_mask = [&](int m, int buf) {
      load_operand_tile<BM, BN, Tr::kMaskPitch, NT>(
          sMask + buf * Tr::kMaskTile, pp.mask + static_cast<int64_t>(m) * BM * s.mask.row_stride,
          s.mask.row_stride, s.mask.col_stride, L.q_len - m * BM, L.kv_len - n0, p.mask_vec,
          mask_one_row, tid);
    };
    // Q, dO, lse, D and bias of query block m into stage st (one commit group).
    auto load_step = [&](int m, int st) {
      const int m0 = m * BM;
      const T* qg = static_cast<const T*>(pp.q);
      const T* dog = static_cast<const T*>(pp.dout);
      const float* lseg = pp.lse;
      const float* dsg = pp.dsum;
      const T* bg = static_cast<const T*>(pp.bias);
      load_tile_async<BM, D, NT>(sQ + st * (Tr::kQBytes / 2), qg + m0 * q_rs, q_rs,
                                 L.q_len - m0, tid);
      load_tile_async<BM, D, NT>(sdO + st * (Tr::kQBytes / 2), dog + m0 * q_rs, q_rs,
                                 L.q_len - m0, tid);
      if (has_segments) {
        load_ids_async<BM, NT>(sRowIds + st * BM, q_segment_row(p, b) + m0, L.q_len - m0, tid);
      }
      if constexpr (kGated) {
        gate().template load_rows_async<BM, NT>(sRowAlpha + st * BM, m0, L.q_len - m0, tid);
      }
      for (int r = tid; r < BM; r += NT) {
        const bool ok = m0 + r < L.q_len;
        cp_async4(smem_u32(sLse + st * BM + r), ok ? lseg + m0 + r : lseg, ok ? 4 : 0);
        cp_async4(smem_u32(sDsum + st * BM + r), ok ? dsg + m0 + r : dsg, ok ? 4 : 0);
      }
      if (has_bias) {
        load_operand_tile<BM, BN, Tr::kBiasPitch, NT>(
            sBias + st * bias_stage, bg + static_cast<int64_t>(m0) * s.bias.row_stride,
            s.bias.row_stride, s.bias.col_stride, L.q_len - m0, L.kv_len - n0, p.bias_vec,
            bias_one_row, tid);
      }
      cp_async_commit();
    };
    const FormEntries form_entries(p.forms, s, b, h);  // read by kIndexed kernels only
    auto walk = [&] {
      const MaskMapView map(p.mask_map, s, b, h);
      if constexpr (kIndexed) {
        return indexed_query_block_walk<BM, BN>(map, has_mask, n0, m_last,
                                                IndexMasks<kIndex>(p, b, form_entries));
      } else {
        return query_block_walk<BM, BN>(map, has_mask, n0, m_last);
      }
    }();
    auto gate_filter = [&] {  // the threshold's verdicts on this key block's grid row blocks
      if constexpr (kGated) {
        return GateFilter<false>(gate(), n0 / static_cast<int>(kGateBlockK));
      } else {
        return 0;
      }
    }();
    const DropFilter<false> drops(p.drop_map, s, b, h, n0 / static_cast<int>(kSkipBlockK));
    auto next_block = [&](int m, int* flags) {
      auto visible = [&](int i, int* f) { return walk.next(i, f); };
      int next = visible(m, flags);
      if constexpr (kGated) {  // past the grid blocks the gate threshold drops
        next = gate_filter.template next_kept<BM>(next, m_last + 1, visible, flags);
      }
      // past the blocks softmax-threshold skipping dropped in the forward
      return drops.next_kept<BM>(next, m_last + 1, visible, flags);
    };

    // First active query block; its mask tile (unless all true) loads with its other tiles, and
    // the pair's kv ids with them (read after that block's barrier). A pair without a block
    // loads no ids: its copy would still be in flight when the next pair's copy is issued to the
    // same words, and could land last (racecheck: windows with sinks and segment ids).
    int flags;     // of block m
    int cur = 0;   // mask buffer of block m
    int m = next_block(m_first, &flags);
    if (m <= m_last) {
      if (has_segments) {
        load_ids_async<BN, NT>(sKeyIds, kv_segment_row(p, b) + n0, L.kv_len - n0, tid);
      }
      if constexpr (kGated) {
        gate().template load_keys_async<BN, NT>(sKeyDelta, n0, L.kv_len - n0, tid);
      }
      if (!(flags & kTileAll)) load_mask(m, cur);
      load_step(m, stage);
    }

    while (m <= m_last) {
      const int m0 = m * BM;
      cp_async_wait<0>();
      if constexpr (Tr::kWgmma) {
        fence_async_shared();
        bulk_wait_read();  // the previous block's dbias tile was read
      }
      __syncthreads();  // block m's tiles (and K, V) visible; the other stage, P, dS free
      if constexpr (Tr::kWgmma) reduce_staged_dq();  // the previous block's

      // ---------------- prefetch: the next active block's mask (and, two stages, its tiles) ----
      int next_flags;
      const int next = next_block(m + 1, &next_flags);
      if (next <= m_last) {
        if (!(next_flags & kTileAll)) load_mask(next, cur ^ 1);
        if constexpr (kStages == 2) {
          load_step(next, stage ^ 1);
        } else {
          cp_async_commit();
        }
      }
      const uint32_t so = static_cast<uint32_t>(stage * Tr::kQBytes);  // stage byte offset
      const T* sB = sBias + stage * bias_stage;
      const float* sL = sLse + stage * BM;
      const float* sD = sDsum + stage * BM;

      // The forms' element test before the GEMM, as in the forward (bit element_bit(mt, t, e)).
      uint32_t form_hidden = 0;
      if (has_mask_forms<kIndex>(p) && (flags & kTileIndexed)) {
        MaskFormsView(p.forms, form_entries).each_form([&](auto sees) {
          for_each_element<MA, NA>([&](int mt, int t, int e) {
            const bool out = !sees(m0 + query_of(t, e), n0 + key_of(mt, e));
            form_hidden |= static_cast<uint32_t>(out) << element_bit(mt, t, e);
          });
        });
      }

      // ---------------- GEMM: S^T = K Q^T + bias^T / scale (fused: and dP^T = V dO^T) --------
      float st[MA][NA][4], dp[MA][NA][4];
      // kRegFrags: P and dS as the A fragments of phase B's k-steps (16 queries each)
      uint32_t pf[kFragSteps][4], dsf[kFragSteps][4];
      // Each optional feature is tested once around its element loop (a branch, not a
      // predicated instruction per element).
      if (has_bias && !bias_one_row) {  // bias^T fragments: ldmatrix.trans of the tile
#pragma unroll
        for (int mt = 0; mt < MA; ++mt)
#pragma unroll
          for (int t = 0; t < NA; t += 2) {
            uint32_t r[4];
            ldsm_x4_t(r, smem_u32(sB + transposed_row(mt, t)));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 bv = E::unpack(r[j]);
              st[mt][t + (j >> 1)][2 * (j & 1)] = bv.x * p.bias_mul;
              st[mt][t + (j >> 1)][2 * (j & 1) + 1] = bv.y * p.bias_mul;
            }
          }
      } else if (has_bias) {
        for_each_element<MA, NA>([&](int mt, int t, int e) {
          st[mt][t][e] = E::to_float(sB[key_of(mt, e)]) * p.bias_mul;
        });
      } else {
        for_each_element<MA, NA>([&](int mt, int t, int e) { st[mt][t][e] = 0.f; });
      }
      if constexpr (Tr::kFusedA) {
        for_each_element<MA, NA>([&](int mt, int t, int e) { dp[mt][t][e] = 0.f; });
      }
      if constexpr (Tr::kWgmma) {
        // S^T and dP^T in flight together (one group: two groups with P computed while dP^T
        // runs make ptxas serialise the wgmmas). Keys ka0 of the warpgroup's first warp.
        const uint32_t k_row = static_cast<uint32_t>((ka0 - (warp % 4) * 16) * 128);
        const uint32_t q_row = static_cast<uint32_t>(qa0 * 128) + so;
        auto k_step = [](int ks) { return kmajor_step(ks, BN); };
        auto q_step = [](int ks) { return kmajor_step(ks, BM); };
        wgmma_group(
            [&] {
              wgmma_issue<0, 0, D / 16>(flat(st), gmma_desc(smem_u32(sK) + k_row, 0),
                                        gmma_desc(smem_u32(sQ) + q_row, 0), k_step, q_step,
                                        T());
              wgmma_issue<0, 0, D / 16>(flat(dp), gmma_desc(smem_u32(sV) + k_row, 0),
                                        gmma_desc(smem_u32(sdO) + q_row, 0), k_step, q_step,
                                        T());
            },
            flat(st), flat(dp));
      } else {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          uint32_t ak[MA][4], av[MA][4];
#pragma unroll
          for (int mt = 0; mt < MA; ++mt) {
            ldsm_x4(ak[mt], fkA(mt * 16, ks * 16));
            if constexpr (Tr::kFusedA) ldsm_x4(av[mt], fvA(mt * 16, ks * 16));
          }
#pragma unroll
          for (int np = 0; np < NA / 2; ++np) {
            uint32_t bq[4], bo[4];
            ldsm_x4(bq, fqA(np * 16, ks * 16) + so);
            if constexpr (Tr::kFusedA) ldsm_x4(bo, foA(np * 16, ks * 16) + so);
#pragma unroll
            for (int mt = 0; mt < MA; ++mt) {
              E::mma(st[mt][2 * np], ak[mt], bq[0], bq[1]);
              E::mma(st[mt][2 * np + 1], ak[mt], bq[2], bq[3]);
              if constexpr (Tr::kFusedA) {
                E::mma(dp[mt][2 * np], av[mt], bo[0], bo[1]);
                E::mma(dp[mt][2 * np + 1], av[mt], bo[2], bo[3]);
              }
            }
          }
        }
      }

      if constexpr (kGated) {  // S^T += logsigmoid(alpha_i delta_j) / scale, with the bias
        const float* alpha = sRowAlpha + stage * BM;
        for_each_element<MA, NA>([&](int mt, int t, int e) {
          const float x = alpha[query_of(t, e)] * sKeyDelta[key_of(mt, e)];
          st[mt][t][e] += log_sigmoid(x) * p.bias_mul;
        });
      }

      // ---------------- visibility, softcap, P = exp(S - lse) -> smem or registers -----------
      const bool need_bounds =
          (m0 + BM > L.q_len) || (n0 + BN > L.kv_len) ||
          (static_cast<int64_t>(n0) - (m0 + BM - 1) < band.dmin) ||
          (static_cast<int64_t>(n0) + BN - 1 - m0 > band.dmax);
      const uint8_t* sm = sMask + cur * Tr::kMaskTile;
      const bool mask_apply = !(flags & kTileAll);
      const bool capped = p.softcap > 0.f;
      uint32_t hidden = 0;  // by the mask tile or the bounds: bit element_bit(mt, t, e)
      if (mask_apply) {
        for_each_element<MA, NA>([&](int mt, int t, int e) {
          const int i = mask_one_row ? 0 : query_of(t, e);
          const bool keep = sm[i * Tr::kMaskPitch + key_of(mt, e)] != 0;
          hidden |= static_cast<uint32_t>(!keep) << element_bit(mt, t, e);
        });
      }
      if (kTable && need_bounds && sees_sink_keys_only<BM, BN>(rule, L, m0, n0)) {
        const int sink_end = min(rule.sink, L.kv_len);
        for_each_element<MA, NA>([&](int mt, int t, int e) {
          hidden |= static_cast<uint32_t>(n0 + key_of(mt, e) >= sink_end) << element_bit(mt, t, e);
        });
      } else if (need_bounds) {
        for_each_element<MA, NA>([&](int mt, int t, int e) {
          const int i = m0 + query_of(t, e), j = n0 + key_of(mt, e);
          bool in;
          if constexpr (kTable) {
            in = i < L.q_len && j < L.kv_len && rule.sees(i, j);
          } else {
            in = i < L.q_len && j < L.kv_len && j - i >= band.dmin && j - i <= band.dmax;
          }
          hidden |= static_cast<uint32_t>(!in) << element_bit(mt, t, e);
        });
      }
      if constexpr (kIndexed) {
        if (has_segments && (flags & kTileIndexed)) {
          const int32_t* row_ids = sRowIds + stage * BM;
          for_each_element<MA, NA>([&](int mt, int t, int e) {
            const bool other = row_ids[query_of(t, e)] != sKeyIds[key_of(mt, e)];
            hidden |= static_cast<uint32_t>(other) << element_bit(mt, t, e);
          });
        }
        hidden |= form_hidden;
      }
      // S = softcap tanh(S / softcap); the dS factor 1 - tanh^2 parks in the dS tile until dS
      // replaces it (each thread reads back only what it wrote itself: no barrier).
      if (capped) {
        for_each_pair<MA, NA>([&](int mt, int t, int h) {
          float fac[2];
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const float tc = accurate_tanh(st[mt][t][2 * h + k] * p.softcap_in);
            st[mt][t][2 * h + k] = p.softcap * tc;
            fac[k] = 1.f - tc * tc;
          }
          *reinterpret_cast<uint32_t*>(sdS + pair_offset(mt, t, h)) = E::pack(fac[0], fac[1]);
        });
      }
      if constexpr (Tr::kAliasBiasP) __syncthreads();  // bias tile (aliased by P) fully read
#pragma unroll
      for (int t = 0; t < NA; ++t) {
        const float2 lse2 = *reinterpret_cast<const float2*>(sL + query_of(t, 0));
        // lse = -inf (no visible key) gives P = 0 without an inf - inf.
        const float l2x = lse2.x == -INFINITY ? INFINITY : lse2.x * kLog2e;
        const float l2y = lse2.y == -INFINITY ? INFINITY : lse2.y * kLog2e;
#pragma unroll
        for (int mt = 0; mt < MA; ++mt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const bool vis = !((hidden >> element_bit(mt, t, e)) & 1u);
            const float x = st[mt][t][e] * p.softmax_mul - ((e & 1) ? l2y : l2x);
            st[mt][t][e] = vis ? fast_exp2(x) : 0.f;
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t packed = E::pack(st[mt][t][2 * h], st[mt][t][2 * h + 1]);
            if constexpr (Tr::kRegFrags) {
              pf[t / 2][(t % 2) * 2 + h] = packed;
            } else {
              *reinterpret_cast<uint32_t*>(sP + pair_offset(mt, t, h)) = packed;
            }
          }
        }
      }

      // keys kb0 of the warpgroup's first warp in phase B; dO and Q are MN-major there (queries
      // down the rows).
      const uint32_t kb_row = static_cast<uint32_t>((kb0 - (warp % 4) * 16) * 128);
      const uint32_t db_col = mnmajor_col(db0, BM) + so;
      auto mn_step = [](int ks) { return mnmajor_step(ks); };
      if constexpr (kEarlyB) {  // GEMM: dV += P^T dO, in flight during dS
        wgmma_async(
            [&] {
              wgmma_issue_rs<1, BM / 16>(flat(dv), pf, gmma_desc(smem_u32(sdO) + db_col, BM * 128),
                                         mn_step, T());
            },
            flat(dv));
      }

      // ---------------- GEMM: dP^T = V dO^T (unless fused above) ------------------------------
      if constexpr (!Tr::kFusedA) {
#pragma unroll
        for (int mt = 0; mt < MA; ++mt)
#pragma unroll
          for (int t = 0; t < NA; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[mt][t][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          uint32_t av[MA][4];
#pragma unroll
          for (int mt = 0; mt < MA; ++mt) ldsm_x4(av[mt], fvA(mt * 16, ks * 16));
#pragma unroll
          for (int np = 0; np < NA / 2; ++np) {
            uint32_t bo[4];
            ldsm_x4(bo, foA(np * 16, ks * 16) + so);
#pragma unroll
            for (int mt = 0; mt < MA; ++mt) {
              E::mma(dp[mt][2 * np], av[mt], bo[0], bo[1]);
              E::mma(dp[mt][2 * np + 1], av[mt], bo[2], bo[3]);
            }
          }
        }
      }

      // ---------------- dS = P (dP - D) (P as stored) -> smem (and registers), dbias ----------
#pragma unroll
      for (int t = 0; t < NA; ++t) {
        const float2 ds2 = *reinterpret_cast<const float2*>(sD + query_of(t, 0));
#pragma unroll
        for (int mt = 0; mt < MA; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float2 pv = E::unpack(
                Tr::kRegFrags ? pf[t / 2][(t % 2) * 2 + h]
                              : *reinterpret_cast<const uint32_t*>(sP + pair_offset(mt, t, h)));
            dp[mt][t][2 * h] = pv.x * (dp[mt][t][2 * h] - ds2.x);
            dp[mt][t][2 * h + 1] = pv.y * (dp[mt][t][2 * h + 1] - ds2.y);
          }
      }
      if (capped) {
        for_each_pair<MA, NA>([&](int mt, int t, int h) {
          const uint32_t fac = *reinterpret_cast<const uint32_t*>(sdS + pair_offset(mt, t, h));
          const float2 f = E::unpack(fac);
          dp[mt][t][2 * h] *= f.x;
          dp[mt][t][2 * h + 1] *= f.y;
        });
      }
      for_each_pair<MA, NA>([&](int mt, int t, int h) {
        const uint32_t packed = E::pack(dp[mt][t][2 * h], dp[mt][t][2 * h + 1]);
        *reinterpret_cast<uint32_t*>(sdS + pair_offset(mt, t, h)) = packed;
        if constexpr (Tr::kRegFrags) dsf[t / 2][(t % 2) * 2 + h] = packed;
      });

      // dbias contributions from registers
      if (dbias_mode != kDbiasNone) {
        if (db_rowsum) {
#pragma unroll
          for (int mt = 0; mt < MA; ++mt)
#pragma unroll
            for (int t = 0; t < NA; ++t) {
              db_acc[mt][0] += dp[mt][t][0] + dp[mt][t][1];
              db_acc[mt][1] += dp[mt][t][2] + dp[mt][t][3];
            }
          db_dirty = true;
        } else if (db_colsum) {
          // per-query sums over this warp's keys, then fp32 atomics
#pragma unroll
          for (int t = 0; t < NA; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float v = 0.f;
#pragma unroll
              for (int mt = 0; mt < MA; ++mt) v += dp[mt][t][e] + dp[mt][t][e + 2];
              v += __shfl_xor_sync(0xffffffffu, v, 4);
              v += __shfl_xor_sync(0xffffffffu, v, 8);
              v += __shfl_xor_sync(0xffffffffu, v, 16);
              const int i = m0 + qa0 + t * 8 + 2 * tq + e;
              if (g == 0 && i < L.q_len && v != 0.f) {
                atomicAdd(p.dbias_accum + pp.dbias_entry + static_cast<int64_t>(i) * dop.row_stride,
                          v);
              }
            }
          }
        } else if (db_staged) {
          // dS^T into the bias tile, in dbias's [query][key] layout; each warp overwrites only the
          // blocks it read. Stored after the barrier.
#pragma unroll
          for (int mt = 0; mt < MA; ++mt)
#pragma unroll
            for (int t = 0; t < NA; t += 2) {
              uint32_t r[4];
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const float* d = dp[mt][t + (j >> 1)] + 2 * (j & 1);
                r[j] = E::pack(d[0], d[1]);
              }
              stsm_x4_t(smem_u32(sB + transposed_row(mt, t)), r);
            }
        } else {
          T* dbg = static_cast<T*>(p.dbias);
#pragma unroll
          for (int mt = 0; mt < MA; ++mt)
#pragma unroll
            for (int t = 0; t < NA; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int i = m0 + qa0 + t * 8 + 2 * tq + (e & 1);
                const int j = n0 + ka0 + mt * 16 + g + (e >> 1) * 8;
                if (i < L.q_len && j < L.kv_len) {
                  const int64_t off = pp.dbias_entry + static_cast<int64_t>(i) * dop.row_stride +
                                      static_cast<int64_t>(j) * dop.col_stride;
                  if (dbias_mode == kDbiasDirect) {
                    dbg[off] = E::from_float(dp[mt][t][e]);
                  } else if (dp[mt][t][e] != 0.f) {
                    atomicAdd(p.dbias_accum + off, dp[mt][t][e]);
                  }
                }
              }
        }
      }

      if constexpr (kEarlyB) {  // GEMM: dK += dS^T Q
        wgmma_async(
            [&] {
              wgmma_issue_rs<1, BM / 16>(flat(dk), dsf, gmma_desc(smem_u32(sQ) + db_col, BM * 128),
                                         mn_step, T());
            },
            flat(dk));
      }
      if constexpr (Tr::kWgmma) fence_async_shared();
      if constexpr (kEarlyB) {
        wgmma_wait<0>();
        fence_operands(flat(dv));
        fence_operands(flat(dk));
      }
      if constexpr (Tr::kWgmma) {
        if (tid == 0) bulk_wait_read();  // the dQ stage was read
      }
      __syncthreads();  // P, dS visible (kEarlyB: Q, dO free); the dQ stage free
      if constexpr (kGated) {  // the gate's gradients from the dS tile, few registers live
        add_gate_grads<BN, BM, NT>(
            gate(), p.dalpha, p.ddelta, sRowAlpha + stage * BM, sKeyDelta, n0, m0, L.kv_len,
            L.q_len, [&](int j, int i) { return E::to_float(sdS[TileP::off(j, i)]); }, tid);
      }
      if (db_staged) {
        T* dbg = static_cast<T*>(p.dbias) + pp.dbias_entry +
                 static_cast<int64_t>(m0) * dop.row_stride + n0;
        if constexpr (Tr::kWgmma) {
          // One copy per row, BM / NW rows per warp: a warp issues its lanes' copies one after
          // the other, so every warp takes a share (H200 harness, bias + mask L4k backward:
          // 4.13 ms with two warps issuing 32 copies each, 3.75 ms with eight issuing 8). Two
          // stages: the barrier at the top of the loop waits for the reads, before the next
          // load into this stage.
          constexpr int kRowsPerWarp = BM / Tr::NW;
          static_assert(BM % Tr::NW == 0 && kRowsPerWarp <= 32, "dbias rows spread over warps");
          const int row = warp * kRowsPerWarp + lane;
          if (lane < kRowsPerWarp && row < L.q_len - m0) {
            bulk_store(dbg + row * dop.row_stride, sB + row * Tr::kBiasPitch,
                       min(BN, L.kv_len - n0) * 2);
            bulk_commit();
          }
          if constexpr (kStages == 1) {  // the next block's bias loads into this tile below
            bulk_wait_read();
            if constexpr (kEarlyB) __syncthreads();
          }
        } else {
          store_padded_tile<BM, BN, Tr::kBiasPitch, NT>(dbg, dop.row_stride, sB, L.q_len - m0,
                                                        L.kv_len - n0, tid);
        }
      }

      // ---------------- GEMMs: dV += P^T dO, dK += dS^T Q (unless started above) -------------
      if constexpr (Tr::kWgmma && !kEarlyB) {
        auto p_step = [](int ks) { return kmajor_step(ks, BN); };
        wgmma_group(
            [&] {
              wgmma_issue<0, 1, BM / 16>(flat(dv), gmma_desc(smem_u32(sP) + kb_row, 0),
                                         gmma_desc(smem_u32(sdO) + db_col, BM * 128), p_step,
                                         mn_step, T());
              wgmma_issue<0, 1, BM / 16>(flat(dk), gmma_desc(smem_u32(sdS) + kb_row, 0),
                                         gmma_desc(smem_u32(sQ) + db_col, BM * 128), p_step,
                                         mn_step, T());
            },
            flat(dv), flat(dk));
      } else if constexpr (!Tr::kWgmma) {
#pragma unroll
        for (int ks = 0; ks < BM / 16; ++ks) {
          uint32_t ap[MB][4], ad[MB][4];
#pragma unroll
          for (int mt = 0; mt < MB; ++mt) {
            if constexpr (Tr::kRegFrags) {
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                ap[mt][r] = pf[ks][r];
                ad[mt][r] = dsf[ks][r];
              }
            } else {
              ldsm_x4(ap[mt], fpB(mt * 16, ks * 16));
              ldsm_x4(ad[mt], fdsB(mt * 16, ks * 16));
            }
          }
#pragma unroll
          for (int dq = 0; dq < DB / 16; ++dq) {
            uint32_t bo[4], bq[4];
            ldsm_x4_t(bo, foB(ks * 16, dq * 16) + so);
            ldsm_x4_t(bq, fqB(ks * 16, dq * 16) + so);
#pragma unroll
            for (int mt = 0; mt < MB; ++mt) {
              E::mma(dv[mt][2 * dq], ap[mt], bo[0], bo[1]);
              E::mma(dv[mt][2 * dq + 1], ap[mt], bo[2], bo[3]);
              E::mma(dk[mt][2 * dq], ad[mt], bq[0], bq[1]);
              E::mma(dk[mt][2 * dq + 1], ad[mt], bq[2], bq[3]);
            }
          }
        }
      }

      if constexpr (kStages == 1) {
        // Q, dO, bias (and P) free: the next block loads during phase C (gated: once every
        // warp has read the stage's alpha in add_gate_grads)
        if constexpr (!kEarlyB || kGated) __syncthreads();
        if (next <= m_last) load_step(next, 0);
      }

      // ---------------- GEMM: dQ += dS K, fp32 atomics (sm_90a: bulk reductions) -------------
      if (p.compute_dq) {
        float* dqg = pp.dq;
#pragma unroll
        for (int ch = 0; ch < DC / CH; ++ch) {
          float acc[MC][CH / 8][4];
#pragma unroll
          for (int mt = 0; mt < MC; ++mt)
#pragma unroll
            for (int t = 0; t < CH / 8; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[mt][t][e] = 0.f;
          if constexpr (Tr::kWgmma) {
            // dS (keys down the rows) and K are both MN-major here.
            const uint32_t k_col = mnmajor_col(dc0 + ch * CH, BN);
            wgmma_group(
                [&] {
                  wgmma_issue<1, 1, BN / 16>(flat(acc), gmma_desc(smem_u32(sdS), BN * 128),
                                             gmma_desc(smem_u32(sK) + k_col, BN * 128),
                                             mn_step, mn_step, T());
                },
                flat(acc));

            // into the stage; the reduction is issued after the next barrier. The stage's
            // swizzle sees a row's index mod 4 (rows r and r + 8 alike) and repeats every 32
            // columns: four column offsets serve all the stores.
            static_assert(CH % 32 == 0, "whole 32-column swizzle periods");
            float* const row = sDq + (qc0 + g) * D;
#pragma unroll
            for (int t = 0; t < CH / 8; ++t) {
              const int col =
                  StagedDq::column(qc0 + g, dc0 + ch * CH + (t % 4) * 8 + 2 * tq) + (t / 4) * 32;
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                *reinterpret_cast<float2*>(row + half * 8 * D + col) =
                    make_float2(acc[0][t][2 * half], acc[0][t][2 * half + 1]);
              }
            }
          } else {
#pragma unroll
            for (int ks = 0; ks < BN / 16; ++ks) {
              uint32_t a[MC][4];
#pragma unroll
              for (int mt = 0; mt < MC; ++mt) ldsm_x4_t(a[mt], fdsC(ks * 16, mt * 16));
#pragma unroll
              for (int dq = 0; dq < CH / 16; ++dq) {
                uint32_t bk[4];
                ldsm_x4_t(bk, fkC(ks * 16, ch * CH + dq * 16));
#pragma unroll
                for (int mt = 0; mt < MC; ++mt) {
                  E::mma(acc[mt][2 * dq], a[mt], bk[0], bk[1]);
                  E::mma(acc[mt][2 * dq + 1], a[mt], bk[2], bk[3]);
                }
              }
            }
#pragma unroll
            for (int mt = 0; mt < MC; ++mt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
              // Lanes tq and tq^1 swap halves so that each owns 4 consecutive columns of one row:
              // the even lane row g, the odd lane row g + 8; one 16-byte vector atomic each.
              const bool odd = (tq & 1) != 0;
              const int i = m0 + qc0 + mt * 16 + g + (odd ? 8 : 0);
              float* row = dqg + static_cast<int64_t>(i) * q_rs + dc0 + ch * CH + 4 * (tq >> 1);
#pragma unroll
              for (int t = 0; t < CH / 8; ++t) {
                const float r0 =
                    __shfl_xor_sync(0xffffffffu, odd ? acc[mt][t][0] : acc[mt][t][2], 1);
                const float r1 =
                    __shfl_xor_sync(0xffffffffu, odd ? acc[mt][t][1] : acc[mt][t][3], 1);
                const float4 v = odd ? make_float4(r0, r1, acc[mt][t][2], acc[mt][t][3])
                                     : make_float4(acc[mt][t][0], acc[mt][t][1], r0, r1);
                if (i < L.q_len) atomicAdd(reinterpret_cast<float4*>(row + t * 8), v);
              }
#else
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                const int i = m0 + qc0 + mt * 16 + g + half * 8;
                if (i < L.q_len) {
                  float* row = dqg + static_cast<int64_t>(i) * q_rs + dc0 + ch * CH + 2 * tq;
#pragma unroll
                  for (int t = 0; t < CH / 8; ++t) {
                    atomicAdd(row + t * 8, acc[mt][t][2 * half]);
                    atomicAdd(row + t * 8 + 1, acc[mt][t][2 * half + 1]);
                  }
                }
              }
#endif
            }
          }
        }
        if constexpr (Tr::kWgmma) {
          dq_dst = dqg + static_cast<int64_t>(m0) * D;
          dq_bytes = min(BM, L.q_len - m0) * D * 4;
        }
      }

      cur ^= 1;
      flags = next_flags;
      if constexpr (kStages == 2) stage ^= 1;
      m = next;
    }

    // Flush the per-key dbias sums when the next pair writes another entry (or at the end).
    if (db_rowsum) {
      bool flush = pi + 1 == pairs;
      if (!flush) {
        const int64_t b2 = batch_of(p, cls, (pi + 1) / G);
        const int h2 = hk * G + static_cast<int>((pi + 1) % G);
        flush = dop.offset(s.batch, b2, h2) != pp.dbias_entry;
      }
      if (flush && db_dirty) {  // db_dirty is CTA-uniform
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < MA; ++mt) {
          float v0 = db_acc[mt][0], v1 = db_acc[mt][1];
          v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
          v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
          v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
          v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
          if (tq == 0) {
            atomicAdd(sDB + ka0 + mt * 16 + g, v0);
            atomicAdd(sDB + ka0 + mt * 16 + g + 8, v1);
          }
          db_acc[mt][0] = db_acc[mt][1] = 0.f;
        }
        __syncthreads();
        if (tid < BN && n0 + tid < Lk) {
          const float v = sDB[tid];
          const int64_t off = pp.dbias_entry + static_cast<int64_t>(n0 + tid) * dop.col_stride;
          if (dbias_mode == kDbiasDirect) {
            static_cast<T*>(p.dbias)[off] = E::from_float(v);
          } else if (v != 0.f) {
            atomicAdd(p.dbias_accum + off, v);
          }
        }
        __syncthreads();
        if (tid < BN) sDB[tid] = 0.f;
        db_dirty = false;
      }
    }
  }

  // ---- epilogue: dK = scale * sum dS^T Q, dV ---------------------------------------------
  if constexpr (Tr::kWgmma) {
    fence_async_shared();
    __syncthreads();
    reduce_staged_dq();
    bulk_wait_read();  // the dQ stage and dbias tiles are read before the CTA exits
  }
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MB; ++mt)
#pragma unroll
    for (int t = 0; t < DB / 8; ++t) {
      const int r = kb0 + mt * 16 + g;
      const int c = db0 + t * 8 + 2 * tq;
      *reinterpret_cast<uint32_t*>(sK + TileKV::off(r, c)) =
          E::pack(dk[mt][t][0] * p.scale, dk[mt][t][1] * p.scale);
      *reinterpret_cast<uint32_t*>(sK + TileKV::off(r + 8, c)) =
          E::pack(dk[mt][t][2] * p.scale, dk[mt][t][3] * p.scale);
      *reinterpret_cast<uint32_t*>(sV + TileKV::off(r, c)) = E::pack(dv[mt][t][0], dv[mt][t][1]);
      *reinterpret_cast<uint32_t*>(sV + TileKV::off(r + 8, c)) =
          E::pack(dv[mt][t][2], dv[mt][t][3]);
    }
  __syncthreads();
  const int64_t dkv_off = p.dkv_batch.offset(s.batch, b_rep) + static_cast<int64_t>(hk) * D +
                          static_cast<int64_t>(n0) * kv_rs;
  store_tile<BN, D, NT>(static_cast<T*>(p.dk) + dkv_off, sK, kv_rs, Lk - n0, tid);
  store_tile<BN, D, NT>(static_cast<T*>(p.dv) + dkv_off, sV, kv_rs, Lk - n0, tid);
}

// p.dbias_fill: zeros for the dbias rows of each (key block, kv head, class) of the main grid that
// no computed query block of its pairs writes (before each computed block, after the last), in
// a pass of its own at full memory bandwidth: a memset of all of dbias writes twice as much for
// a causal call, and the same stores inside the main kernel stall its CTAs.
template <int BM, int BN, typename T>
__device__ __forceinline__ void zero_unwritten_dbias(const BwdParams& p) {
  const AttentionShape& s = p.s;
  const int Hk = static_cast<int>(s.num_kv_heads);
  const int G = static_cast<int>(s.num_heads / s.num_kv_heads);
  const int64_t bid = blockIdx.x;
  const int n0 = static_cast<int>(bid % p.n_blocks) * BN;
  const int hk = static_cast<int>((bid / p.n_blocks) % Hk);
  const int64_t cls = bid / p.n_blocks / Hk;
  const int Lq = static_cast<int>(s.seqlen_q), Lk = static_cast<int>(s.seqlen_k);
  const SeqLens L = seq_lens(s, nullptr, nullptr, 0);  // dbias_fill: no sequence lengths
  int m_first, m_last;
  query_blocks_seeing<BM, BN>(n0, L, position_rule(s, p.windows, hk), &m_first, &m_last);
  for (int64_t pi = 0; pi < p.kv_members * G; ++pi) {
    const int64_t b = batch_of(p, cls, pi / G);
    const int h = hk * G + static_cast<int>(pi % G);
    auto walk = query_block_walk<BM, BN>(MaskMapView(p.mask_map, s, b, h), p.mask != nullptr,
                                         n0, m_last);
    T* cols = static_cast<T*>(p.dbias) + p.dbias_op.offset(s.batch, b, h) + n0;
    int from = 0, flags;
    for (int m = walk.next(m_first, &flags);; m = walk.next(m + 1, &flags)) {
      const int to = m <= m_last ? m * BM : Lq;
      zero_rows<kZeroThreads>(cols, p.dbias_op.row_stride, from, to, min(BN, Lk - n0),
                              threadIdx.x);
      if (m > m_last) break;
      from = to + BM;
    }
  }
}

}  // namespace detail

// Tiles too large for sm_80's shared memory, tiles that stage dQ off sm_90a, and OffHopper tiles
// on sm_90a compile to a trap (they are never launched there: launch_template.cuh picks tiles by
// device). kBias: the call has a bias (without, none of the bias and dbias code takes registers
// from the GEMMs); kIndex: the index masks compiled (IndexKind, index_masks.cuh), kTable a window
// table (likewise).
template <typename Tr, typename T, bool kBias, int kIndex, bool kTable>
__global__ void __launch_bounds__(Tr::kNT, Tr::kMinBlocks)
    bwd_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH__)
  constexpr bool kCompiled = (__CUDA_ARCH__ >= 900 || Tr::kSmem <= kSmemLimitSm80) &&
                             (!Tr::kDqStaged || Tr::kWgmma) && !(kSm90aPass && Tr::kOffHopper);
#else
  constexpr bool kCompiled = true;
#endif
  if constexpr (!kCompiled) {
    __trap();
  } else {
    detail::bwd_main<Tr, T, kBias, kIndex, kTable>(p);
  }
}

template <int BM, int BN, typename T>
__global__ void __launch_bounds__(kZeroThreads)
    bwd_zero_dbias(const __grid_constant__ BwdParams p) {
  detail::zero_unwritten_dbias<BM, BN, T>(p);
}

// Eight consecutive elements as floats (one 16-byte load of a 16-bit type, two of float).
template <typename T>
__device__ __forceinline__ void load8(const T* x, float (&v)[8]) {
  const uint4 w = *reinterpret_cast<const uint4*>(x);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = detail::Elem<T>::unpack(words[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* x, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(x)[0];
  const float4 b = reinterpret_cast<const float4*>(x)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Threads per row of the preprocess: the largest power of two up to 32 that divides D / 8.
constexpr int PreprocessLanes(int d) {
  int lanes = 1;
  while (lanes < 32 && (d / 8) % (2 * lanes) == 0) lanes *= 2;
  return lanes;
}

// softmax_d[b, h, i] = sum_d dout * out - dlse. PreprocessLanes(D) neighbouring threads per
// (b, i, h) row, 16-byte loads of 8 elements each (one warp per row with 4-byte loads ran at a
// third of the memory bandwidth at D = 64); out is T or float.
template <int D, typename T, typename O>
__global__ void bwd_preprocess(const __grid_constant__ BwdParams p, const O* out,
                               const float* dlse, float* softmax_d, int64_t rows) {
  constexpr int kLanes = PreprocessLanes(D);
  static_assert(D % (8 * kLanes) == 0, "whole 8-element chunks per thread");
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = t / kLanes;
  const int lane = static_cast<int>(t % kLanes);
  float acc = 0.f;
  if (r < rows) {
    const O* o = out + r * D;
    const T* d = static_cast<const T*>(p.dout) + r * D;
#pragma unroll
    for (int c = lane * 8; c < D; c += 8 * kLanes) {
      float x[8], y[8];
      load8(o + c, x);
      load8(d + c, y);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc += x[i] * y[i];
    }
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (r < rows && lane == 0) {
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

// The same from the StagedDq accumulator; thread n converts q's elements 8 n .. 8 n + 7.
template <int D, typename T>
__global__ void bwd_dq_convert_staged(const __grid_constant__ BwdParams p, T* __restrict__ dq,
                                      int64_t n8) {
  using E = detail::Elem<T>;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= n8) return;
  const AttentionShape& s = p.s;
  const int c = static_cast<int>((n * 8) % D);
  const int64_t r = n * 8 / D;  // (b, i, h) of q's rows
  const int64_t h = r % s.num_heads, i = (r / s.num_heads) % s.seqlen_q;
  const int64_t b = r / s.num_heads / s.seqlen_q;
  const float* row = p.dq_accum + (StagedDq::row(s, b, h) + i) * D;
  const int i4 = static_cast<int>(i % 4);
  const float4 a = *reinterpret_cast<const float4*>(row + StagedDq::column(i4, c));
  const float4 e = *reinterpret_cast<const float4*>(row + StagedDq::column(i4, c + 4));
  uint4 o;
  o.x = E::pack(a.x * s.scale, a.y * s.scale);
  o.y = E::pack(a.z * s.scale, a.w * s.scale);
  o.z = E::pack(e.x * s.scale, e.y * s.scale);
  o.w = E::pack(e.z * s.scale, e.w * s.scale);
  reinterpret_cast<uint4*>(dq)[n] = o;
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
