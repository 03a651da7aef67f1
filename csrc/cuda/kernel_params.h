// Kernel-side parameter blocks (host and device). Built by launch.cu from the AttentionShape and
// the call's pointers; passed to the kernels by value (__grid_constant__).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace dmattn::cuda {

// Flags of the mask per 64 x 64 cell (kTileAny | kTileAll), built in one pass before the attention
// kernels (block_map.cu) so that they find their next non-empty tile, and skip the element test of
// all-true tiles, from a few bytes. One mask entry (the [Lq|1, Lk|1] slice of a batch/head entry)
// has rows x cols cells, row-major; a dim the mask broadcasts over has one cell. The same pass
// packs the mask to bits (cuda/attention.h), which the Hopper forward reads instead of its bytes.
struct MaskBlockMap {
  const uint8_t* cells = nullptr;
  const uint8_t* bits = nullptr;
  int64_t entry_elems = 1;  // mask elements per entry
  int rows = 0;
  int cols = 0;
};

// Ids per cell of the segment id spans.
constexpr int kSegmentCell = 64;

// The {min, max} of every kSegmentCell ids of each segment id row (segments.cuh), written by a
// pass before the attention kernels: the `rows` rows of q ids ([rows][q_cells]), then those of
// kv ids ([rows][kv_cells]). A row is the segments_batch offset of a batch entry.
struct SegmentSpanLayout {
  const int2* spans = nullptr;
  int64_t rows = 0;
  int q_cells = 0, kv_cells = 0;
};

// Positions per cell of the range summaries (MaskForms).
constexpr int kRangeCell = 64;

// n / d for 0 <= n < 2^31 by a multiply-high and a shift (Granlund-Montgomery, as CUTLASS's
// FastDivmod): the element tests of block indices divide every position by a block size.
struct FastDiv {
  uint32_t mul = 0;
  uint32_t shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t d) {
    while ((1ull << shift) < d) ++shift;
    mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
#if defined(__CUDACC__)
  __device__ __forceinline__ int operator()(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
    return static_cast<int>((__umulhi(u, mul) + u) >> shift);
  }
#endif
};

// The O(L) mask forms (AttentionShape: key_ranges, row_ranges, block_indices) as the
// FlashAttention-2-class kernels read them (mask_forms.cuh); null pointers where the call has no
// such form. A pass before the attention kernels (mask_forms.cu) writes their summaries, so that
// a tile walk learns what a tile's ranges or blocks leave visible from a few loads:
//   key_cells [key-range entries][ceil(Lk / kRangeCell)] and row_cells [row-range entries]
//   [ceil(Lq / kRangeCell)]: per cell of keys (rows), int4 {min start and max end of its
//   non-empty ranges, max start and min end of all of them} (RangeHull);
//   block_bits [block entries][block_rows][block_words]: bit kb of row qb is set when query
//   block qb lists key block kb.
// An entry is the form's [Lk], [Lq] or [nQB, K] slice of one (batch, head) entry.
struct MaskForms {
  bool present = false;
  int lq = 0, lk = 0;  // the call's Lq and Lk: the ranges' lengths
  const int32_t* key_start = nullptr;
  const int32_t* key_end = nullptr;
  const int4* key_cells = nullptr;
  const int32_t* row_start = nullptr;
  const int32_t* row_end = nullptr;
  const int4* row_cells = nullptr;
  const uint32_t* block_bits = nullptr;
  int block_rows = 0, block_words = 0;
  FastDiv div_q, div_k;  // by block_q, block_k
};

// Per-kv-head windows with sinks (AttentionShape::head_windows, a host table) as the kernels read
// it, by value: kv head g sees, by position, the keys of its band (the call's diagonal window
// narrowed by g's window, as offsets j - i) and the keys j < sink under the call's own window
// (detail::PositionRule). heads == 0: the call has no table. Calls with more kv heads than fit
// (kMaxWindowHeads, common/params.h) are refused (SupportsHeadWindows).
struct HeadWindow {
  int dmin, dmax;  // the band; +-2^30: unbounded
  int sink;        // keys [0, sink), sink <= Lk
};
struct HeadWindows {
  int heads = 0;
  HeadWindow head[kMaxWindowHeads];
};

// The bounds of the gate threshold (gate.cu's pass, with a threshold only): [min, max] of alpha
// over each grid block of kGateBlockQ rows of each (batch entry, query head) and of delta over
// each kGateBlockK keys of each (batch entry, kv head), both NaN where a value is; the walks test
// a grid block on them (gate.cuh: GateFilter) instead of on the block's 256 values.
struct GateBounds {
  const float2* rows = nullptr;  // [batch, H, row_blocks]
  const float2* keys = nullptr;  // [batch, Hk, key_blocks]
  int row_blocks = 0, key_blocks = 0;
};

struct FwdParams {
  AttentionShape s;
  const void* q;
  const void* k;
  const void* v;
  const uint8_t* mask;  // null when absent
  MaskBlockMap mask_map;
  const void* bias;     // null when absent
  const int32_t* q_lens;
  const int32_t* kv_lens;
  const int32_t* page_table;  // a paged k and v (the decode forward only), or null
  // Null without segment ids: [segment rows, Lq] / [segment rows, Lk], and their spans.
  const int32_t* q_segments;
  const int32_t* kv_segments;
  SegmentSpanLayout segment_spans;
  void* out;
  float* lse;
  bool out_f32;  // out is float32, else T

  int m_blocks;
  // Null: each (batch, head) runs its query blocks from the last to the first. Else
  // [batch_count * H, m_blocks]: the query block of each rank, heaviest first, written by the
  // kernels of block_order.cuh before the forward reads it (block_weight: their scratch, as big).
  int32_t* block_order;
  int32_t* block_weight;
  // The Hopper forward's tile counter (sm90/fwd_scheduler.cuh), zeroed by its launcher; null
  // when the workspace has no room for it.
  int* tile_counter;
  // Split-KV when num_splits > 1: split s of a query block covers key blocks [s * split_blocks,
  // (s + 1) * split_blocks) and writes its normalised partial output and lse (fp32) to
  // o_partial [splits, B * H, Lq, D] and lse_partial [splits, B * H, Lq]; the combine kernel
  // (fwd_combine.cuh) merges them into out and lse.
  int num_splits;
  int split_blocks;
  float* o_partial;
  float* lse_partial;
  // The decode forward's count, per (batch, kv head, row block), of the splits that wrote their
  // partial results (zeroed by its launcher): the last one merges them. Null: the combine kernel
  // merges.
  int* split_counters;
  // The accumulator holds acc = q.k + bias / scale, so the logit is z = scale * acc. Without a
  // softcap the score array keeps acc; with one it keeps s = softcap * tanh(acc * softcap_in).
  float bias_mul;     // 1 / scale
  float softcap_in;   // scale / softcap
  float softcap;      // 0: none
  float softmax_mul;  // log2(e) * scale, or log2(e) when softcapped
  float lse_mul;      // scale, or 1 when softcapped: natural-log units of the row max
  bool mask_vec;      // mask tiles can use 16-byte cp.async
  bool bias_vec;      // bias tiles can use 16-byte cp.async
  // Last, so that the kernels without a table see the other fields where they always were.
  HeadWindows windows;
  MaskForms forms;  // after the table, for the same reason
  // The gate (gate.cuh), or null: alpha [*batch, Lq, H], delta [*batch, Lk, Hk], fp32.
  const float* alpha;
  const float* delta;
  GateBounds gate_bounds;
  // Softmax-threshold skipping's drop map (AttentionShape::drop_map_offset), or null: written by
  // the Hopper threshold kernels (sm90/fwd_threshold.cuh) over zeros.
  uint8_t* drop_map;
};

// dbias handling in the backward.
enum DbiasMode : int {
  kDbiasNone = 0,
  kDbiasDirect = 1,  // each dbias element is owned by one CTA: plain stores of bf16/fp16
  kDbiasAtomic = 2,  // fp32 atomics into a workspace of bias.num_elements, then a convert pass
};

// Query rows per dQ turn flag of the deterministic Hopper backward (its query block).
constexpr int kDqTurnRows = 64;

struct BwdParams {
  AttentionShape s;
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;
  const float* softmax_d;  // rowsum(dout*out) - dlse, [*batch, H, Lq]
  const uint8_t* mask;
  MaskBlockMap mask_map;
  const void* bias;
  const int32_t* q_lens;
  const int32_t* kv_lens;
  const int32_t* q_segments;  // as in FwdParams
  const int32_t* kv_segments;
  SegmentSpanLayout segment_spans;
  float* dq_accum;  // [*batch, Lq, H, D] fp32 (zeroed by the launcher)
  // The deterministic Hopper backward's dQ turn flags, [*batch, H, ceil(Lq / kDqTurnRows)]: 1 +
  // the key block that last added to the rows' dq_accum, 0 before any (zeroed by the launcher).
  // Null for every other call.
  int32_t* dq_turns;
  void* dk;
  void* dv;
  void* dbias;        // dbias in the bias dtype (direct mode)
  float* dbias_accum;  // fp32 workspace (atomic mode)

  // dk / dv slots: the CTA for (n_block, kv head, class) sums over the `members` batches of its
  // class and the query heads of its kv head's group. Batch dim d is a member dim when
  // member_dim[d] (dk/dv broadcast over it).
  BatchStrides dkv_batch;
  int member_dim[kMaxBatchDims];
  int64_t kv_classes;
  int64_t kv_members;

  int n_blocks;
  // Null: each (kv head, class) runs its key blocks in order. Else [Hk * kv_classes, n_blocks]:
  // the key block of each rank, heaviest first (block_order.cuh; block_weight: its scratch).
  int32_t* block_order;
  int32_t* block_weight;
  int dbias_mode;
  // Direct full-size dbias without sequence lengths: zeros only where the main kernel computes
  // nothing (bwd_zero_dbias), not a memset of all of dbias.
  bool dbias_fill;
  // Direct full-size dbias whose rows and key blocks split into 16-byte chunks: the main kernel
  // stores whole tiles of it from shared memory.
  bool dbias_staged;
  // Addressing of the dbias operand (its own strides: a bias broadcast over batch dims may have
  // a full-size dbias, the vmap layout).
  BroadcastOperand dbias_op;

  float bias_mul;     // as in FwdParams
  float softcap_in;
  float softcap;
  float softmax_mul;
  float scale;
  bool mask_vec;
  bool bias_vec;
  bool compute_dq;  // false: a separate deterministic dq kernel runs
  // With a window table (last, as in FwdParams): ranks_outer: CTAs take ranks as the slow index
  // (bwd_cta), so that every (kv head, class) starts its first ranks at once (a sink's key
  // blocks see every query block).
  bool ranks_outer;
  HeadWindows windows;
  MaskForms forms;
  // The gate (gate.cuh), or null (as FwdParams'), and its gradients (fp32, zeroed by the
  // launcher, the kernels add into them).
  const float* alpha;
  const float* delta;
  float* dalpha;
  float* ddelta;
  GateBounds gate_bounds;
  // The forward's drop map (softmax-threshold skipping), or null: its blocks are skipped.
  const uint8_t* drop_map;
};

}  // namespace dmattn::cuda
