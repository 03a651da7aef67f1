// The one description of an attention call, shared by the CPU and CUDA kernels.
//
// The FFI layer (csrc/ffi/decode.cc) builds an AttentionShape from the buffers' dimensions and the
// call's attributes once; kernels read every operand through it, so broadcasting (stride 0), GQA
// head mapping and the visibility rule live in exactly one place.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DMATTN_HD __host__ __device__ __forceinline__
#else
#define DMATTN_HD inline
#endif

namespace dmattn {

// vmap adds leading batch dims; the FFI layer accepts up to this many after merging neighbours.
constexpr int kMaxBatchDims = 4;
// Platform workspaces a call may carry after its results (CUDA backward: dq and dbias
// accumulators).
constexpr int kMaxWorkspaces = 2;
// Rows and columns of one cell of the CUDA kernels' mask block map (cuda/attention.h).
constexpr int kMaskMapCell = 64;
// Kv heads of the largest per-kv-head window table (AttentionShape::head_windows) that the CUDA
// kernels take: it travels in their parameters (cuda/kernel_params.h).
constexpr int kMaxWindowHeads = 64;
// Bytes per row of the CUDA kernels' bit-packed mask (cuda/attention.h): a bit per key, rows
// padded to whole 16-byte units (128 keys), which TMA can address.
constexpr int64_t MaskBitsRowBytes(int64_t cols) { return (cols + 127) / 128 * 16; }
// The fixed grid of the gate threshold (AttentionShape::gate_cut): blocks of kGateBlockQ query
// rows × kGateBlockK keys from position 0, per (batch, query head). Mirrored by
// jax_dmattn/params.py (GATE_BLOCK_Q, GATE_BLOCK_K); kernels of any tile shape drop the same
// blocks, so results never depend on a kernel's tiles.
constexpr int64_t kGateBlockQ = 128;
constexpr int64_t kGateBlockK = 128;
// Softmax-threshold tile skipping (AttentionShape::softmax_threshold) decides on a grid of its
// own: blocks of 64 query rows (one consumer warpgroup's rows in the Hopper forward, which then
// decides alone) × 128 keys from position 0. Mirrored by jax_dmattn/params.py (SKIP_BLOCK_Q,
// SKIP_BLOCK_K).
constexpr int64_t kSkipBlockQ = 64;
constexpr int64_t kSkipBlockK = 128;
// A paged KV cache's page size is a power of two, at least this (KvPages): every kernel's key
// tile (at most this many keys, starting at a multiple of it) then lies in one page.
constexpr int64_t kMinPageSize = 64;

enum class ElementType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The problem's leading batch dims (those of q, out and lse). Kernels see one flat batch index.
struct BatchShape {
  int32_t rank = 0;
  int64_t sizes[kMaxBatchDims] = {1, 1, 1, 1};

  DMATTN_HD int64_t count() const {
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= sizes[d];
    return n;
  }
};

// An operand's element strides over the problem's batch dims: 0 where the operand broadcasts.
struct BatchStrides {
  int64_t strides[kMaxBatchDims] = {0, 0, 0, 0};

  DMATTN_HD int64_t offset(const BatchShape& shape, int64_t flat_batch) const {
    int64_t off = 0;
    for (int d = shape.rank - 1; d >= 0; --d) {
      off += (flat_batch % shape.sizes[d]) * strides[d];
      flat_batch /= shape.sizes[d];
    }
    return off;
  }
};

// A mask, bias or dbias of shape [*batch|1, H|Hk|1, Lq|1, Lk|1], contiguous in its own shape and
// addressed through strides that are 0 on its size-1 (broadcast) dims. For dbias those are the
// dims it is summed over.
struct BroadcastOperand {
  bool present = false;
  BatchStrides batch;
  int64_t heads_per_entry = 1;  // query heads that share one head entry: H / its head count
  int64_t head_stride = 0;
  int64_t row_stride = 0;  // 0 when broadcast over queries
  int64_t col_stride = 0;  // 0 when broadcast over keys
  int64_t num_elements = 0;

  // Offset of element (batch b, query head h, row 0, column 0).
  DMATTN_HD int64_t offset(const BatchShape& shape, int64_t b, int64_t h) const {
    return batch.offset(shape, b) + (h / heads_per_entry) * head_stride;
  }
  DMATTN_HD bool broadcast_over_rows() const { return row_stride == 0; }
  DMATTN_HD bool broadcast_over_cols() const { return col_stride == 0; }
};

// A paged KV cache (forward only): k and v are pools [num_pages, page_size, Hk, D] shared by the
// batch, and key j of batch entry b is row j % page_size of page page_table[b][j / page_size]
// (page_table int32 [*batch|1, Lk / page_size]). Viewed as [num_pages * page_size, Hk, D] rows,
// that is row page * page_size + j % page_size. A page index outside [0, num_pages) is clamped
// into it: a table entry a sequence's length reaches must name a page (the Python front end
// checks tables it can see), and a wrong one is never read past the pool.
struct KvPages {
  int64_t page_size = 0;  // a power of two; 0: k and v are contiguous [*batch|1, Lk, Hk, D]
  int32_t page_shift = 0;  // log2(page_size)
  int64_t num_pages = 0;
  int64_t max_pages = 0;     // the table's row length: Lk / page_size
  BatchStrides table_batch;  // in elements of the table

  DMATTN_HD bool present() const { return page_size > 0; }
  DMATTN_HD const int32_t* table_row(const int32_t* table, const BatchShape& batch,
                                     int64_t b) const {
    return table + table_batch.offset(batch, b);
  }
  // The table entry of key j.
  DMATTN_HD int64_t entry_of(int64_t j) const { return j >> page_shift; }
  // The pool row of key j in the page a table entry names.
  DMATTN_HD int64_t row_in(int64_t page, int64_t j) const {
    page = page < 0 ? 0 : (page >= num_pages ? num_pages - 1 : page);
    return (page << page_shift) + (j & (page_size - 1));
  }
  // The pool row of key j for a sequence whose table row is `row`.
  DMATTN_HD int64_t key_row(const int32_t* row, int64_t j) const {
    return row_in(row[entry_of(j)], j);
  }
};

// Shapes, layouts and the math of one call.
//   q, out, dout, dq: [*batch, Lq, H, D]   k, v: [*batch|1, Lk, Hk, D]   dk, dv: [*batch|1, ...]
//                                      (k, v paged: KvPages, forward only)
//   lse, softmax_d:   [*batch, H, Lq] fp32 q_lens, kv_lens: [*batch|1] int32
//   q_segments: [*batch|1, Lq] int32     kv_segments: [*batch|1, Lk] int32 (the same batch dims)
//   key_start, key_end: [*batch|1, H|Hk|1, 1, Lk] int32 (the same dims)
//   row_start, row_end: [*batch|1, H|Hk|1, Lq, 1] int32 (the same dims)
//   block_indices: [*batch|1, H|Hk|1, ceil(Lq / block_q), K] int32
//   alpha: [*batch, Lq, H] fp32        delta: [*batch, Lk, Hk] fp32 (the gate; dalpha, ddelta
//                                      alike)
// Gradients have their own layouts (dkv_batch, dbias): a gradient sums over exactly the dims where
// ITS buffer has size 1, which may differ from where the input broadcasts (under vmap an unmapped
// k or bias is read with stride 0 but its per-example gradient is full-size).
struct AttentionShape {
  BatchShape batch;
  int64_t seqlen_q = 0, seqlen_k = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  ElementType dtype = ElementType::kFloat32;  // q, k, v, out, bias (and their gradients)

  BatchStrides kv_batch;       // k, v (all 0 when paged)
  KvPages pages;               // a paged k and v, or page_size 0
  BatchStrides dkv_batch;      // dk, dv (backward only)
  BatchStrides seqlens_batch;  // q_lens, kv_lens
  bool has_seqlens = false;
  // Sequence packing: key j is visible to query i only if q_segments[i] == kv_segments[j].
  BatchStrides segments_batch;  // in rows of ids: a row is Lq (q_segments) or Lk elements
  bool has_segments = false;
  // Key ranges (an O(Lk) mask): key j is visible to query i only if key_start[j] <= i <
  // key_end[j]. Laid out as a mask broadcast over rows; one layout for both arrays.
  BroadcastOperand key_ranges;
  // Row ranges (an O(Lq) mask, the mirror): query i sees key j only if row_start[i] <= j <
  // row_end[i]. Laid out as a mask broadcast over columns; one layout for both arrays.
  BroadcastOperand row_ranges;
  // Block indices (a block-sparse mask): query i sees key j only if j / block_k is among the
  // K entries of query block i / block_q (entries outside [0, ceil(Lk / block_k)), -1 for an
  // unused slot, name no block). Addressed as an operand [nQB, K] per head entry: row_stride K
  // per query block, col_stride 1 per slot.
  BroadcastOperand block_indices;
  int64_t block_q = 0, block_k = 0, block_slots = 0;  // block_slots: K
  BroadcastOperand mask, bias;
  BroadcastOperand dbias;  // backward with a bias only

  float scale = 1.f;
  float softcap = 0.f;  // 0: no softcap
  // Key j is visible to query i iff  i + diagonal_offset - window_left <= j
  //                               and j <= i + diagonal_offset + window_right,
  // a window bound < 0 meaning unbounded; causal is window_right = 0. Lengths, segments, key
  // and row ranges, block indices and the mask apply too.
  int64_t diagonal_offset = 0;
  int64_t window_left = -1, window_right = -1;
  // Per-kv-head windows with sinks, or null: row g of this [Hk, 3] table, (sink, left, right),
  // further limits the queries of kv head g to keys j < sink or
  // i + diagonal_offset - left <= j <= i + diagonal_offset + right (a bound < 0 unbounded),
  // and-ed with the rule above (so causality hides the sink's future keys too). Host memory of
  // the call's attribute, valid during the call (the CUDA launchers copy it into their kernels'
  // parameters).
  const int64_t* head_windows = nullptr;
  // Gated attention: the scores gain logsigmoid(alpha[b, i, h] * delta[b, j, h / (H / Hk)])
  // (added with the bias, before the softcap). With gate_cut > -inf, a kGateBlockQ × kGateBlockK
  // block of the grid above is dropped for query head h (never computed, in every pass) when
  // max(alpha_i * delta_j) over its rows and keys, taken from the corner products of alpha's and
  // delta's min and max there (in double: exact for float32 values), is below gate_cut (the
  // product whose logsigmoid is the user's threshold).
  bool has_gate = false;
  double gate_cut = -INFINITY;
  // Softmax-threshold skipping (> 0; 0: exact). The forward walks each kSkipBlockQ-row block's
  // kSkipBlockQ × kSkipBlockK blocks of the grid above in increasing key order and drops a block
  // (no V read, no P·V) when every visible score s_ij there is below
  //   running_lse_i + log(softmax_threshold / n_i)
  // for every row i of the block, running_lse_i the log-sum-exp of row i's visible scores in the
  // blocks kept before it (-inf before the first: a row's first block with a visible key is
  // never dropped) and n_i the number of keys row i may see by position alone
  // (RowKeys: Lk or kv_len, causality, the window, its kv head's window and sink). It writes
  // drop_map (1 = dropped) and the backward skips exactly those blocks.
  double softmax_threshold = 0.0;
  bool deterministic = false;

  DMATTN_HD int64_t batch_count() const { return batch.count(); }
  // Key ranges, row ranges or block indices: the O(L) mask forms.
  DMATTN_HD bool has_mask_forms() const {
    return key_ranges.present || row_ranges.present || block_indices.present;
  }
  DMATTN_HD int64_t heads_per_kv_head() const { return num_heads / num_kv_heads; }
  // A gate threshold: some grid blocks may be dropped.
  DMATTN_HD bool has_gate_threshold() const { return has_gate && gate_cut > -INFINITY; }

  // Element offsets of row 0 / head h of each operand family for flat batch index b.
  DMATTN_HD int64_t q_offset(int64_t b, int64_t h) const {
    return b * seqlen_q * num_heads * head_dim + h * head_dim;
  }
  DMATTN_HD int64_t q_row_stride() const { return num_heads * head_dim; }
  DMATTN_HD int64_t kv_offset(int64_t b, int64_t kv_head) const {
    return kv_batch.offset(batch, b) + kv_head * head_dim;
  }
  DMATTN_HD int64_t dkv_offset(int64_t b, int64_t kv_head) const {
    return dkv_batch.offset(batch, b) + kv_head * head_dim;
  }
  DMATTN_HD int64_t kv_row_stride() const { return num_kv_heads * head_dim; }
  DMATTN_HD int64_t lse_offset(int64_t b, int64_t h) const {
    return (b * num_heads + h) * seqlen_q;
  }
  // Gate operands: alpha [*batch, Lq, H] (row stride H), delta [*batch, Lk, Hk] (row stride Hk).
  DMATTN_HD int64_t alpha_offset(int64_t b, int64_t h) const {
    return b * seqlen_q * num_heads + h;
  }
  DMATTN_HD int64_t delta_offset(int64_t b, int64_t kv_head) const {
    return b * seqlen_k * num_kv_heads + kv_head;
  }
  // The drop map of softmax-threshold skipping: uint8 [*batch, H, ceil(Lq / kSkipBlockQ),
  // ceil(Lk / kSkipBlockK)].
  DMATTN_HD int64_t skip_rows() const { return (seqlen_q + kSkipBlockQ - 1) / kSkipBlockQ; }
  DMATTN_HD int64_t skip_cols() const { return (seqlen_k + kSkipBlockK - 1) / kSkipBlockK; }
  DMATTN_HD int64_t drop_map_offset(int64_t b, int64_t h) const {
    return (b * num_heads + h) * skip_rows() * skip_cols();
  }
  DMATTN_HD int64_t drop_map_bytes() const { return drop_map_offset(batch_count(), 0); }

  // The first key past the keys row i may see from the diagonal/window rule alone (no mask, no
  // lengths), and the first key it may see; an empty range when first >= end.
  DMATTN_HD int64_t first_visible_key(int64_t i) const {
    if (window_left < 0) return 0;
    const int64_t first = i + diagonal_offset - window_left;
    return first < 0 ? 0 : first;
  }
  DMATTN_HD int64_t end_visible_key(int64_t i, int64_t kv_len) const {
    if (window_right < 0) return kv_len;
    const int64_t end = i + diagonal_offset + window_right + 1;
    return end < kv_len ? (end < 0 ? 0 : end) : kv_len;
  }
};

// The gate threshold's rule for one grid block whose alpha lies in [a_lo, a_hi] and delta in
// [d_lo, d_hi]: kept unless every corner product (the largest alpha_i * delta_j over the block
// is one of them) lies below `cut`; in double, exact for float32 values. A NaN corner (a NaN
// bound, 0 * inf) keeps it: the rule drops a block only when every pair is below the cut.
DMATTN_HD bool GateBlockKept(double a_lo, double a_hi, double d_lo, double d_hi, double cut) {
  const double corners[4] = {a_lo * d_lo, a_lo * d_hi, a_hi * d_lo, a_hi * d_hi};
  bool kept = false;
  for (int k = 0; k < 4; ++k) kept |= !(corners[k] < cut);
  return kept;
}

// Pointers of a forward call. Optional operands are null when absent.
struct ForwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const bool* mask = nullptr;
  const void* bias = nullptr;
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  const int32_t* page_table = nullptr;  // a paged k and v (AttentionShape::pages), or null
  const int32_t* q_segments = nullptr;
  const int32_t* kv_segments = nullptr;
  const int32_t* key_start = nullptr;  // key ranges, or null
  const int32_t* key_end = nullptr;
  const int32_t* row_start = nullptr;  // row ranges, or null
  const int32_t* row_end = nullptr;
  const int32_t* block_indices = nullptr;  // block indices, or null
  const float* alpha = nullptr;  // the gate, or null
  const float* delta = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  uint8_t* drop_map = nullptr;  // softmax-threshold skipping's dropped blocks, or null
  bool out_f32 = false;  // out is float32 (the backward's residual), else q's dtype
  const uint8_t* mask_map = nullptr;  // CUDA, with a mask: its block map (cuda/attention.h)
  const uint8_t* mask_bits = nullptr;  // CUDA, with a mask: the mask packed to bits (same)
  // Platform workspaces (FFI outputs sized at trace time), in the order the Python op declares.
  void* workspace[kMaxWorkspaces] = {};
  int64_t workspace_bytes[kMaxWorkspaces] = {};
};

// Pointers of a backward call. dlse is the cotangent of lse (zeros unless lse was used).
struct BackwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  bool out_f32 = false;  // out is float32 (the forward's exact output), else q's dtype
  const void* dout = nullptr;
  const float* lse = nullptr;
  const float* dlse = nullptr;
  const bool* mask = nullptr;
  const uint8_t* mask_map = nullptr;  // CUDA, with a mask: its block map (cuda/attention.h)
  const uint8_t* mask_bits = nullptr;  // CUDA, with a mask: the mask packed to bits (same)
  const void* bias = nullptr;
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  const int32_t* q_segments = nullptr;
  const int32_t* kv_segments = nullptr;
  const int32_t* key_start = nullptr;  // key ranges, or null
  const int32_t* key_end = nullptr;
  const int32_t* row_start = nullptr;  // row ranges, or null
  const int32_t* row_end = nullptr;
  const int32_t* block_indices = nullptr;  // block indices, or null
  const float* alpha = nullptr;  // the gate, or null
  const float* delta = nullptr;
  const uint8_t* drop_map = nullptr;  // the forward's dropped blocks, or null
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dbias = nullptr;  // null when there is no bias
  float* dalpha = nullptr;  // null without a gate
  float* ddelta = nullptr;
  float* softmax_d = nullptr;  // [*batch, H, Lq] workspace: rowsum(dout * out) - dlse
  void* workspace[kMaxWorkspaces] = {};
  int64_t workspace_bytes[kMaxWorkspaces] = {};
};

// The gradient of dynamic attention's per-block key gathers (jax_dmattn/dynamic.py):
//   out[b, j, c, :] = sum of grad[b, n, slots[b, cc, n, j], c, :] over the blocks n in
//   [spans[b, cc, 0, j], spans[b, cc, 1, j]) (those that list key j; slots outside [0, U) add
//   nothing), cc = c or 0 (key lists shared by the channels). grad [*B, nb, U, C, D],
//   slots [*B, Cc, nb, Lk], spans [*B, Cc, 2, Lk] int32, out [*B, Lk, C, D]; fp32 sums in a
//   fixed order, no atomics.
struct ListedKeysShape {
  int64_t batch = 0;  // product of the leading dims
  int64_t blocks = 0, slots = 0, channels = 0, dim = 0, key_channels = 0, seqlen_k = 0;
  ElementType dtype = ElementType::kFloat32;  // grad and out
};

struct ListedKeysArgs {
  const void* grad = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* spans = nullptr;
  void* out = nullptr;
};

}  // namespace dmattn
