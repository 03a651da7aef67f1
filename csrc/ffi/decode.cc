#include "ffi/decode.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace dmattn {
namespace ffi = xla::ffi;

namespace {

ffi::Error Invalid(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_dmattn: " + message);
}

std::string DimsString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool SameDims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// Hands out a call's buffers in order, naming each in errors.
class Cursor {
 public:
  Cursor(const Buffers& buffers, const char* what) : buffers_(buffers), what_(what) {}
  ffi::ErrorOr<ffi::AnyBuffer> Next(const char* name) {
    if (next_ >= buffers_.size()) {
      return ffi::Unexpected(Invalid(std::string("missing ") + what_ + " " + name));
    }
    return buffers_[next_++];
  }
  bool done() const { return next_ == buffers_.size(); }
  // The remaining results are platform workspaces.
  ffi::Error Workspaces(void* (&out)[kMaxWorkspaces], int64_t (&bytes)[kMaxWorkspaces]) {
    if (buffers_.size() - next_ > kMaxWorkspaces) return Invalid("too many workspace results");
    for (int i = 0; next_ < buffers_.size(); ++i, ++next_) {
      out[i] = buffers_[next_].untyped_data();
      bytes[i] = static_cast<int64_t>(buffers_[next_].size_bytes());
    }
    return ffi::Error::Success();
  }

 private:
  const Buffers& buffers_;
  const char* what_;
  size_t next_ = 0;
};

#define DMATTN_ASSIGN_OR_RETURN(lhs, expr) \
  auto lhs##_or = (expr);                  \
  if (lhs##_or.has_error()) return lhs##_or.error(); \
  auto lhs = *lhs##_or

ffi::ErrorOr<ElementType> AttentionElementType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return ElementType::kFloat32;
    case ffi::DataType::F16: return ElementType::kFloat16;
    case ffi::DataType::BF16: return ElementType::kBFloat16;
    default: return ffi::Unexpected(Invalid("q must be float32, float16 or bfloat16"));
  }
}

// Natural strides over the problem's batch dims, 0 where the operand has size 1 (broadcast).
ffi::ErrorOr<BatchStrides> BroadcastBatchStrides(ffi::AnyBuffer::Dimensions dims,
                                                 const BatchShape& batch, const char* name) {
  BatchStrides out;
  int64_t stride = 1;
  for (size_t d = batch.rank; d < dims.size(); ++d) stride *= dims[d];
  for (int d = batch.rank - 1; d >= 0; --d) {
    if (dims[d] != batch.sizes[d] && dims[d] != 1) {
      return ffi::Unexpected(Invalid(std::string(name) + " batch dims " + DimsString(dims) +
                                     " do not broadcast to the query's"));
    }
    out.strides[d] = dims[d] == 1 ? 0 : stride;
    stride *= dims[d];
  }
  return out;
}

ffi::Error ExpectSameType(ffi::AnyBuffer x, ffi::DataType type, const char* name) {
  if (x.element_type() != type) return Invalid(std::string(name) + " has the wrong dtype");
  return ffi::Error::Success();
}

// The per-kv-head window table: empty (none) or [Hk, 3] rows (sink >= 0, left, right).
ffi::Error DecodeHeadWindows(ffi::Span<const int64_t> table, AttentionShape* s) {
  if (table.size() == 0) return ffi::Error::Success();
  if (static_cast<int64_t>(table.size()) != 3 * s->num_kv_heads) {
    return Invalid("window_sizes has " + std::to_string(table.size()) +
                   " entries, expected 3 per kv head (" + std::to_string(s->num_kv_heads) +
                   " kv heads)");
  }
  for (int64_t g = 0; g < s->num_kv_heads; ++g) {
    if (table[3 * g] < 0) {
      return Invalid("window_sizes sink of kv head " + std::to_string(g) + " is negative");
    }
  }
  s->head_windows = table.begin();
  return ffi::Error::Success();
}

// q's dims and dtype, and the attributes every call shares.
ffi::Error DecodeQuery(ffi::AnyBuffer q, const AttentionAttrs& attrs, AttentionShape* s) {
  const auto qd = q.dimensions();
  const int64_t rank = qd.size();
  if (rank < 3 || rank - 3 > kMaxBatchDims) {
    return Invalid("q must have rank 3.." + std::to_string(3 + kMaxBatchDims) + ", got " +
                   DimsString(qd));
  }
  s->batch.rank = static_cast<int32_t>(rank - 3);
  for (int d = 0; d < s->batch.rank; ++d) s->batch.sizes[d] = qd[d];
  s->seqlen_q = qd[rank - 3];
  s->num_heads = qd[rank - 2];
  s->head_dim = qd[rank - 1];
  DMATTN_ASSIGN_OR_RETURN(dtype, AttentionElementType(q.element_type()));
  s->dtype = dtype;

  s->scale = attrs.scale;
  s->softcap = attrs.softcap;
  s->diagonal_offset = attrs.diagonal_offset;
  s->window_left = attrs.window_left;
  s->window_right = attrs.window_right;
  s->deterministic = attrs.deterministic;
  s->has_gate = attrs.has_gate;
  s->gate_cut = attrs.gate_cut;
  if (std::isnan(attrs.gate_cut)) return Invalid("gate_cut is NaN");
  if (!(attrs.softmax_threshold >= 0.0) || std::isinf(attrs.softmax_threshold))
    return Invalid("softmax_threshold must be finite and >= 0");
  s->softmax_threshold = attrs.softmax_threshold;
  return ffi::Error::Success();
}

// k and v of one shape and q's dtype, whose heads divide q's; the problem's sizes checked.
ffi::Error ExpectKeysAndValues(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               AttentionShape* s) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (!SameDims(kd, v.dimensions())) return Invalid("k and v shapes differ");
  if (kd.back() != s->head_dim || s->num_kv_heads <= 0 || s->num_heads % s->num_kv_heads) {
    return Invalid("k " + DimsString(kd) + " does not match q " + DimsString(qd));
  }
  if (s->seqlen_q <= 0 || s->seqlen_k <= 0 || s->head_dim <= 0) {
    return Invalid("empty q or k: " + DimsString(qd) + DimsString(kd));
  }
  if (auto e = ExpectSameType(k, q.element_type(), "k"); e.failure()) return e;
  return ExpectSameType(v, q.element_type(), "v");
}

// Contiguous k, v: [*batch|1, Lk, Hk, D], q's rank.
ffi::Error DecodeProblem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         const AttentionAttrs& attrs, AttentionShape* s) {
  if (attrs.page_size != 0) return Invalid("page_size is for the forward only");
  if (auto e = DecodeQuery(q, attrs, s); e.failure()) return e;
  const auto kd = k.dimensions();
  const int64_t rank = q.dimensions().size();
  if (static_cast<int64_t>(kd.size()) != rank) {
    return Invalid("q, k ranks differ: " + DimsString(q.dimensions()) + DimsString(kd));
  }
  s->seqlen_k = kd[rank - 3];
  s->num_kv_heads = kd[rank - 2];
  if (auto e = ExpectKeysAndValues(q, k, v, s); e.failure()) return e;
  DMATTN_ASSIGN_OR_RETURN(kv_batch, BroadcastBatchStrides(kd, s->batch, "k"));
  s->kv_batch = kv_batch;
  return DecodeHeadWindows(attrs.window_sizes, s);
}

// Paged k, v: pools [num_pages, page_size, Hk, D] and their page table int32
// [*batch|1, max_pages]; Lk = max_pages * page_size.
ffi::Error DecodePagedProblem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer table, const AttentionAttrs& attrs,
                              AttentionShape* s) {
  if (auto e = DecodeQuery(q, attrs, s); e.failure()) return e;
  const auto kd = k.dimensions(), td = table.dimensions();
  const int64_t page_size = attrs.page_size;
  if (page_size < kMinPageSize || (page_size & (page_size - 1)) != 0 || kd.size() != 4 ||
      kd[1] != page_size || kd[0] < 1) {
    return Invalid("paged k must be [num_pages >= 1, page_size, Hk, D] with page_size a power "
                   "of two >= " + std::to_string(kMinPageSize) + ", got " + DimsString(kd) +
                   " for page_size " + std::to_string(page_size));
  }
  if (table.element_type() != ffi::DataType::S32 ||
      static_cast<int>(td.size()) != s->batch.rank + 1) {
    return Invalid("page_table must be int32 [*batch, max_pages], got " + DimsString(td));
  }
  if (attrs.has_segments || attrs.has_key_ranges || attrs.has_row_ranges ||
      attrs.has_block_indices || attrs.has_gate || attrs.softmax_threshold > 0.0 ||
      attrs.window_sizes.size() != 0 || !attrs.has_seqlens) {
    return Invalid("a paged call takes sequence lengths, a mask and a bias only");
  }
  s->num_kv_heads = kd[2];
  s->seqlen_k = td.back() * page_size;
  if (auto e = ExpectKeysAndValues(q, k, v, s); e.failure()) return e;
  DMATTN_ASSIGN_OR_RETURN(table_batch, BroadcastBatchStrides(td, s->batch, "page_table"));
  s->pages.page_size = page_size;
  while ((int64_t{1} << s->pages.page_shift) < page_size) ++s->pages.page_shift;
  s->pages.num_pages = kd[0];
  s->pages.max_pages = td.back();
  s->pages.table_batch = table_batch;
  return ffi::Error::Success();
}

// A mask or bias: [*batch|1, H|Hk|1, Lq|1, Lk|1].
ffi::Error DecodeBroadcastOperand(ffi::AnyBuffer x, const AttentionShape& s, const char* name,
                                  BroadcastOperand* op) {
  const auto dims = x.dimensions();
  const int r = s.batch.rank;
  if (static_cast<int>(dims.size()) != r + 3) {
    return Invalid(std::string(name) + " has rank " + std::to_string(dims.size()) +
                   ", expected " + std::to_string(r + 3));
  }
  const int64_t heads = dims[r], rows = dims[r + 1], cols = dims[r + 2];
  if ((heads != 1 && heads != s.num_kv_heads && heads != s.num_heads) ||
      (rows != 1 && rows != s.seqlen_q) || (cols != 1 && cols != s.seqlen_k)) {
    return Invalid(std::string(name) + " shape " + DimsString(dims) + " is not broadcastable");
  }
  DMATTN_ASSIGN_OR_RETURN(batch, BroadcastBatchStrides(dims, s.batch, name));
  op->present = true;
  op->batch = batch;
  op->heads_per_entry = s.num_heads / heads;
  op->head_stride = rows * cols;
  op->row_stride = rows == 1 ? 0 : cols;
  op->col_stride = cols == 1 ? 0 : 1;
  op->num_elements = static_cast<int64_t>(x.element_count());
  return ffi::Error::Success();
}

ffi::Error DecodeSeqlens(ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, AttentionShape* s) {
  for (auto lens : {q_lens, kv_lens}) {
    if (lens.element_type() != ffi::DataType::S32 ||
        static_cast<int>(lens.dimensions().size()) != s->batch.rank) {
      return Invalid("sequence lengths must be int32 of the query's batch rank");
    }
  }
  if (!SameDims(q_lens.dimensions(), kv_lens.dimensions())) {
    return Invalid("q_lens and kv_lens shapes differ");
  }
  DMATTN_ASSIGN_OR_RETURN(strides, BroadcastBatchStrides(q_lens.dimensions(), s->batch, "lens"));
  s->seqlens_batch = strides;
  s->has_seqlens = true;
  return ffi::Error::Success();
}

// The CUDA kernels' mask block map and bit-packed mask of `mask`, checked against its dims.
ffi::Error DecodeMaskSummaries(ffi::AnyBuffer map, ffi::AnyBuffer bits, ffi::AnyBuffer mask,
                               const uint8_t** map_out, const uint8_t** bits_out) {
  if (map.element_type() != ffi::DataType::U8 ||
      !IsMaskMapOf(map.dimensions(), mask.dimensions())) {
    return Invalid("mask_map must be uint8 of the mask's dims with its last two divided by " +
                   std::to_string(kMaskMapCell) + " (rounded up), got " +
                   DimsString(map.dimensions()) + " for mask " + DimsString(mask.dimensions()));
  }
  if (bits.element_type() != ffi::DataType::U8 ||
      !IsMaskBitsOf(bits.dimensions(), mask.dimensions())) {
    return Invalid("mask_bits must be uint8 of the mask's dims with its last one in bytes of "
                   "bits, padded to 16, got " + DimsString(bits.dimensions()) + " for mask " +
                   DimsString(mask.dimensions()));
  }
  *map_out = static_cast<const uint8_t*>(map.untyped_data());
  *bits_out = static_cast<const uint8_t*>(bits.untyped_data());
  return ffi::Error::Success();
}

// Segment ids: int32 [*batch|1, Lq] and [*batch|1, Lk], with the same batch dims.
ffi::Error DecodeSegments(ffi::AnyBuffer q_segments, ffi::AnyBuffer kv_segments,
                          AttentionShape* s) {
  const auto qd = q_segments.dimensions(), kd = kv_segments.dimensions();
  const int r = s->batch.rank;
  bool ok = q_segments.element_type() == ffi::DataType::S32 &&
            kv_segments.element_type() == ffi::DataType::S32 &&
            static_cast<int>(qd.size()) == r + 1 && static_cast<int>(kd.size()) == r + 1 &&
            qd[r] == s->seqlen_q && kd[r] == s->seqlen_k;
  for (int d = 0; ok && d < r; ++d) ok = qd[d] == kd[d];
  if (!ok) {
    return Invalid("segment ids must be int32 [*batch, Lq] and [*batch, Lk] with the same batch "
                   "dims, got " + DimsString(qd) + " and " + DimsString(kd));
  }
  DMATTN_ASSIGN_OR_RETURN(strides, BroadcastBatchStrides(qd, s->batch, "segment ids"));
  for (int d = 0; d < r; ++d) strides.strides[d] /= std::max<int64_t>(s->seqlen_q, 1);  // rows
  s->segments_batch = strides;
  s->has_segments = true;
  return ffi::Error::Success();
}

// Key ranges (int32 [*batch|1, H|Hk|1, 1, Lk], a mask broadcast over rows) or row ranges
// ([*batch|1, H|Hk|1, Lq, 1], broadcast over columns): start and end with the same dims.
ffi::Error DecodeRanges(ffi::AnyBuffer start, ffi::AnyBuffer end, int64_t rows, int64_t cols,
                        const char* name, const char* layout, AttentionShape* s,
                        BroadcastOperand* out) {
  const auto sd = start.dimensions();
  const int r = s->batch.rank;
  const bool ok = start.element_type() == ffi::DataType::S32 &&
                  end.element_type() == ffi::DataType::S32 && SameDims(sd, end.dimensions()) &&
                  static_cast<int>(sd.size()) == r + 3 && sd[r + 1] == rows && sd[r + 2] == cols;
  if (!ok) {
    return Invalid(std::string(name) + " must be int32 " + layout +
                   " twice with the same dims, got " + DimsString(sd) + " and " +
                   DimsString(end.dimensions()));
  }
  return DecodeBroadcastOperand(start, *s, name, out);
}

// Block indices: int32 [*batch|1, H|Hk|1, ceil(Lq / block_q), K] with K >= 1 and positive block
// sizes; addressed per head entry as [nQB, K] (a row per query block, a column per slot).
ffi::Error DecodeBlockIndices(ffi::AnyBuffer indices, int64_t block_q, int64_t block_k,
                              AttentionShape* s) {
  const auto dims = indices.dimensions();
  const int r = s->batch.rank;
  const bool sizes_ok = block_q > 0 && block_k > 0;
  const bool ok = sizes_ok && indices.element_type() == ffi::DataType::S32 &&
                  static_cast<int>(dims.size()) == r + 3 &&
                  dims[r + 1] == (s->seqlen_q + block_q - 1) / block_q && dims[r + 2] >= 1;
  if (!ok) {
    return Invalid("block indices must be int32 [*batch, H|Hk|1, ceil(Lq / block_q), K >= 1] "
                   "with block sizes >= 1, got " + DimsString(dims) + " with block_q " +
                   std::to_string(block_q) + ", block_k " + std::to_string(block_k));
  }
  const int64_t heads = dims[r];
  if (heads != 1 && heads != s->num_kv_heads && heads != s->num_heads) {
    return Invalid("block indices shape " + DimsString(dims) + " is not broadcastable");
  }
  DMATTN_ASSIGN_OR_RETURN(batch, BroadcastBatchStrides(dims, s->batch, "block indices"));
  BroadcastOperand& op = s->block_indices;
  op.present = true;
  op.batch = batch;
  op.heads_per_entry = s->num_heads / heads;
  op.head_stride = dims[r + 1] * dims[r + 2];
  op.row_stride = dims[r + 2];
  op.col_stride = 1;
  op.num_elements = static_cast<int64_t>(indices.element_count());
  s->block_q = block_q;
  s->block_k = block_k;
  s->block_slots = dims[r + 2];
  return ffi::Error::Success();
}

// A gate operand or its gradient: float32 [*batch, L, heads], the query's batch dims in full.
ffi::Error ExpectGateOperand(ffi::AnyBuffer x, const AttentionShape& s, int64_t length,
                             int64_t heads, const char* name) {
  const auto dims = x.dimensions();
  const int r = s.batch.rank;
  bool ok = x.element_type() == ffi::DataType::F32 && static_cast<int>(dims.size()) == r + 2 &&
            dims[r] == length && dims[r + 1] == heads;
  for (int d = 0; ok && d < r; ++d) ok = dims[d] == s.batch.sizes[d];
  return ok ? ffi::Error::Success()
            : Invalid(std::string(name) + " must be float32 [*batch, " + std::to_string(length) +
                      ", " + std::to_string(heads) + "] with the query's batch dims, got " +
                      DimsString(dims));
}

// softmax-threshold skipping's drop map: uint8 [*batch, H, ceil(Lq / kSkipBlockQ),
// ceil(Lk / kSkipBlockK)], the query's batch dims in full.
ffi::Error ExpectDropMap(ffi::AnyBuffer x, const AttentionShape& s) {
  const auto dims = x.dimensions();
  const int r = s.batch.rank;
  bool ok = x.element_type() == ffi::DataType::U8 && static_cast<int>(dims.size()) == r + 3 &&
            dims[r] == s.num_heads && dims[r + 1] == s.skip_rows() &&
            dims[r + 2] == s.skip_cols();
  for (int d = 0; ok && d < r; ++d) ok = dims[d] == s.batch.sizes[d];
  return ok ? ffi::Error::Success()
            : Invalid("drop_map must be uint8 [*batch, H, ceil(Lq / 64), ceil(Lk / 128)] with "
                      "the query's batch dims, got " + DimsString(dims));
}

// The optional operands shared by forward and backward (the mask map last, after a mask) into
// the call's pointers (ForwardArgs or BackwardArgs).
template <typename Args>
ffi::Error DecodeOptionalOperands(Cursor& cursor, const AttentionAttrs& attrs,
                                  ffi::DataType dtype, AttentionShape* s, Args* p) {
  std::optional<ffi::AnyBuffer> mask_buffer;
  if (attrs.has_mask) {
    DMATTN_ASSIGN_OR_RETURN(m, cursor.Next("mask"));
    if (m.element_type() != ffi::DataType::PRED) return Invalid("mask must be bool");
    if (auto e = DecodeBroadcastOperand(m, *s, "mask", &s->mask); e.failure()) return e;
    p->mask = static_cast<const bool*>(m.untyped_data());
    mask_buffer = m;
  }
  if (attrs.has_bias) {
    DMATTN_ASSIGN_OR_RETURN(b, cursor.Next("bias"));
    if (auto e = ExpectSameType(b, dtype, "bias"); e.failure()) return e;
    if (auto e = DecodeBroadcastOperand(b, *s, "bias", &s->bias); e.failure()) return e;
    p->bias = b.untyped_data();
  }
  if (attrs.has_seqlens) {
    DMATTN_ASSIGN_OR_RETURN(ql, cursor.Next("q_lens"));
    DMATTN_ASSIGN_OR_RETURN(kl, cursor.Next("kv_lens"));
    if (auto e = DecodeSeqlens(ql, kl, s); e.failure()) return e;
    p->q_lens = static_cast<const int32_t*>(ql.untyped_data());
    p->kv_lens = static_cast<const int32_t*>(kl.untyped_data());
  }
  if (attrs.has_segments) {
    DMATTN_ASSIGN_OR_RETURN(qs, cursor.Next("q_segments"));
    DMATTN_ASSIGN_OR_RETURN(ks, cursor.Next("kv_segments"));
    if (auto e = DecodeSegments(qs, ks, s); e.failure()) return e;
    p->q_segments = static_cast<const int32_t*>(qs.untyped_data());
    p->kv_segments = static_cast<const int32_t*>(ks.untyped_data());
  }
  if (attrs.has_key_ranges) {
    DMATTN_ASSIGN_OR_RETURN(ks, cursor.Next("key_start"));
    DMATTN_ASSIGN_OR_RETURN(ke, cursor.Next("key_end"));
    if (auto e = DecodeRanges(ks, ke, 1, s->seqlen_k, "key ranges", "[*batch, H|Hk|1, 1, Lk]",
                              s, &s->key_ranges);
        e.failure()) {
      return e;
    }
    p->key_start = static_cast<const int32_t*>(ks.untyped_data());
    p->key_end = static_cast<const int32_t*>(ke.untyped_data());
  }
  if (attrs.has_row_ranges) {
    DMATTN_ASSIGN_OR_RETURN(rs, cursor.Next("row_start"));
    DMATTN_ASSIGN_OR_RETURN(re, cursor.Next("row_end"));
    if (auto e = DecodeRanges(rs, re, s->seqlen_q, 1, "row ranges", "[*batch, H|Hk|1, Lq, 1]",
                              s, &s->row_ranges);
        e.failure()) {
      return e;
    }
    p->row_start = static_cast<const int32_t*>(rs.untyped_data());
    p->row_end = static_cast<const int32_t*>(re.untyped_data());
  }
  if (attrs.has_block_indices) {
    DMATTN_ASSIGN_OR_RETURN(bi, cursor.Next("block_indices"));
    if (auto e = DecodeBlockIndices(bi, attrs.block_q, attrs.block_k, s); e.failure()) return e;
    p->block_indices = static_cast<const int32_t*>(bi.untyped_data());
  }
  if (attrs.has_gate) {
    DMATTN_ASSIGN_OR_RETURN(alpha, cursor.Next("alpha"));
    DMATTN_ASSIGN_OR_RETURN(delta, cursor.Next("delta"));
    if (auto e = ExpectGateOperand(alpha, *s, s->seqlen_q, s->num_heads, "alpha"); e.failure())
      return e;
    if (auto e = ExpectGateOperand(delta, *s, s->seqlen_k, s->num_kv_heads, "delta");
        e.failure())
      return e;
    p->alpha = static_cast<const float*>(alpha.untyped_data());
    p->delta = static_cast<const float*>(delta.untyped_data());
  }
  if constexpr (std::is_same_v<Args, BackwardArgs>) {
    if (attrs.softmax_threshold > 0.0) {
      DMATTN_ASSIGN_OR_RETURN(drops, cursor.Next("drop_map"));
      if (auto e = ExpectDropMap(drops, *s); e.failure()) return e;
      p->drop_map = static_cast<const uint8_t*>(drops.untyped_data());
    }
  }
  if (mask_buffer && !cursor.done()) {
    DMATTN_ASSIGN_OR_RETURN(map, cursor.Next("mask_map"));
    DMATTN_ASSIGN_OR_RETURN(bits, cursor.Next("mask_bits"));
    return DecodeMaskSummaries(map, bits, *mask_buffer, &p->mask_map, &p->mask_bits);
  }
  return ffi::Error::Success();
}

ffi::Error ExpectLikeQ(ffi::AnyBuffer x, ffi::AnyBuffer q, const char* name) {
  if (!SameDims(x.dimensions(), q.dimensions()) || x.element_type() != q.element_type()) {
    return Invalid(std::string(name) + " must have q's shape and dtype");
  }
  return ffi::Error::Success();
}

// The attention output: q's shape, q's dtype or float32 (*f32 says which). A half-precision call
// keeps its output in float32 for the backward, whose D_i = dout_i . out_i must not carry the
// output's rounding (it cancels against P_ij dP_ij for a sharp softmax).
ffi::Error ExpectOutput(ffi::AnyBuffer x, ffi::AnyBuffer q, const char* name, bool* f32) {
  *f32 = x.element_type() == ffi::DataType::F32;
  if (!SameDims(x.dimensions(), q.dimensions()) ||
      !(*f32 || x.element_type() == q.element_type())) {
    return Invalid(std::string(name) + " must have q's shape and q's dtype or float32");
  }
  return ffi::Error::Success();
}

// dk and dv: k's dims except batch dims, where they may be full although k broadcasts.
ffi::Error DecodeKvGradient(ffi::AnyBuffer dk, ffi::AnyBuffer dv, ffi::AnyBuffer k,
                            AttentionShape* s) {
  const auto gd = dk.dimensions(), kd = k.dimensions();
  bool ok = SameDims(gd, dv.dimensions()) && gd.size() == kd.size() &&
            dk.element_type() == k.element_type() && dv.element_type() == k.element_type();
  for (size_t d = s->batch.rank; ok && d < kd.size(); ++d) ok = gd[d] == kd[d];
  if (!ok) return Invalid("dk/dv " + DimsString(gd) + " do not match k " + DimsString(kd));
  auto strides = BroadcastBatchStrides(gd, s->batch, "dk");
  if (strides.has_error()) return strides.error();
  s->dkv_batch = *strides;
  return ffi::Error::Success();
}

ffi::Error ExpectLse(ffi::AnyBuffer x, const AttentionShape& s, const char* name) {
  const auto dims = x.dimensions();
  bool ok = x.element_type() == ffi::DataType::F32 &&
            static_cast<int>(dims.size()) == s.batch.rank + 2 &&
            dims[s.batch.rank] == s.num_heads && dims[s.batch.rank + 1] == s.seqlen_q;
  for (int d = 0; ok && d < s.batch.rank; ++d) ok = dims[d] == s.batch.sizes[d];
  return ok ? ffi::Error::Success()
            : Invalid(std::string(name) + " must be float32 [*batch, H, Lq], got " +
                      DimsString(dims));
}

}  // namespace

namespace {

ffi::ErrorOr<Buffers> ArgBuffers(const ffi::RemainingArgs& args) {
  Buffers out;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return ffi::Unexpected(buffer.error());
    out.push_back(*buffer);
  }
  return out;
}

ffi::ErrorOr<Buffers> RetBuffers(const ffi::RemainingRets& rets) {
  Buffers out;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return ffi::Unexpected(buffer.error());
    out.push_back(**buffer);
  }
  return out;
}

}  // namespace

ffi::Error DecodeForward(const Buffers& args, const Buffers& rets, const AttentionAttrs& attrs,
                         AttentionShape* s, ForwardArgs* p) {
  Cursor in(args, "operand");
  DMATTN_ASSIGN_OR_RETURN(q, in.Next("q"));
  DMATTN_ASSIGN_OR_RETURN(k, in.Next("k"));
  DMATTN_ASSIGN_OR_RETURN(v, in.Next("v"));
  if (attrs.page_size > 0) {
    DMATTN_ASSIGN_OR_RETURN(table, in.Next("page_table"));
    if (auto e = DecodePagedProblem(q, k, v, table, attrs, s); e.failure()) return e;
    p->page_table = static_cast<const int32_t*>(table.untyped_data());
  } else if (auto e = DecodeProblem(q, k, v, attrs, s); e.failure()) {
    return e;
  }
  if (auto e = DecodeOptionalOperands(in, attrs, q.element_type(), s, p); e.failure()) {
    return e;
  }
  if (!in.done()) return Invalid("unexpected extra operands");
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();

  Cursor results(rets, "result");
  DMATTN_ASSIGN_OR_RETURN(out, results.Next("out"));
  DMATTN_ASSIGN_OR_RETURN(lse, results.Next("lse"));
  if (auto e = ExpectOutput(out, q, "out", &p->out_f32); e.failure()) return e;
  if (auto e = ExpectLse(lse, *s, "lse"); e.failure()) return e;
  p->out = out.untyped_data();
  p->lse = static_cast<float*>(lse.untyped_data());
  if (attrs.softmax_threshold > 0.0) {
    DMATTN_ASSIGN_OR_RETURN(drops, results.Next("drop_map"));
    if (auto e = ExpectDropMap(drops, *s); e.failure()) return e;
    p->drop_map = static_cast<uint8_t*>(drops.untyped_data());
  }
  return results.Workspaces(p->workspace, p->workspace_bytes);
}

ffi::Error DecodeBackward(const Buffers& args, const Buffers& rets, const AttentionAttrs& attrs,
                          AttentionShape* s, BackwardArgs* p) {
  Cursor in(args, "operand");
  DMATTN_ASSIGN_OR_RETURN(q, in.Next("q"));
  DMATTN_ASSIGN_OR_RETURN(k, in.Next("k"));
  DMATTN_ASSIGN_OR_RETURN(v, in.Next("v"));
  DMATTN_ASSIGN_OR_RETURN(out, in.Next("out"));
  DMATTN_ASSIGN_OR_RETURN(dout, in.Next("dout"));
  DMATTN_ASSIGN_OR_RETURN(lse, in.Next("lse"));
  DMATTN_ASSIGN_OR_RETURN(dlse, in.Next("dlse"));
  if (auto e = DecodeProblem(q, k, v, attrs, s); e.failure()) return e;
  if (auto e = ExpectOutput(out, q, "out", &p->out_f32); e.failure()) return e;
  if (auto e = ExpectLikeQ(dout, q, "dout"); e.failure()) return e;
  if (auto e = ExpectLse(lse, *s, "lse"); e.failure()) return e;
  if (auto e = ExpectLse(dlse, *s, "dlse"); e.failure()) return e;
  if (auto e = DecodeOptionalOperands(in, attrs, q.element_type(), s, p); e.failure()) {
    return e;
  }
  if (!in.done()) return Invalid("unexpected extra operands");
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->out = out.untyped_data();
  p->dout = dout.untyped_data();
  p->lse = static_cast<const float*>(lse.untyped_data());
  p->dlse = static_cast<const float*>(dlse.untyped_data());

  Cursor grads(rets, "result");
  DMATTN_ASSIGN_OR_RETURN(dq, grads.Next("dq"));
  DMATTN_ASSIGN_OR_RETURN(dk, grads.Next("dk"));
  DMATTN_ASSIGN_OR_RETURN(dv, grads.Next("dv"));
  if (auto e = ExpectLikeQ(dq, q, "dq"); e.failure()) return e;
  if (auto e = DecodeKvGradient(dk, dv, k, s); e.failure()) return e;
  p->dq = dq.untyped_data();
  p->dk = dk.untyped_data();
  p->dv = dv.untyped_data();
  if (attrs.has_bias) {
    DMATTN_ASSIGN_OR_RETURN(dbias, grads.Next("dbias"));
    if (auto e = ExpectSameType(dbias, q.element_type(), "dbias"); e.failure()) return e;
    if (auto e = DecodeBroadcastOperand(dbias, *s, "dbias", &s->dbias); e.failure()) return e;
    p->dbias = dbias.untyped_data();
  }
  if (attrs.has_gate) {
    DMATTN_ASSIGN_OR_RETURN(dalpha, grads.Next("dalpha"));
    DMATTN_ASSIGN_OR_RETURN(ddelta, grads.Next("ddelta"));
    if (auto e = ExpectGateOperand(dalpha, *s, s->seqlen_q, s->num_heads, "dalpha");
        e.failure())
      return e;
    if (auto e = ExpectGateOperand(ddelta, *s, s->seqlen_k, s->num_kv_heads, "ddelta");
        e.failure())
      return e;
    p->dalpha = static_cast<float*>(dalpha.untyped_data());
    p->ddelta = static_cast<float*>(ddelta.untyped_data());
  }
  DMATTN_ASSIGN_OR_RETURN(softmax_d, grads.Next("softmax_d"));
  if (auto e = ExpectLse(softmax_d, *s, "softmax_d"); e.failure()) return e;
  p->softmax_d = static_cast<float*>(softmax_d.untyped_data());
  return grads.Workspaces(p->workspace, p->workspace_bytes);
}

template <typename Ptrs>
static ffi::Error DecodeFrame(
    ffi::Error (*decode)(const Buffers&, const Buffers&, const AttentionAttrs&, AttentionShape*,
                         Ptrs*),
    const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, const AttentionAttrs& attrs,
    AttentionShape* shape, Ptrs* ptrs) {
  auto in = ArgBuffers(args);
  if (in.has_error()) return in.error();
  auto out = RetBuffers(rets);
  if (out.has_error()) return out.error();
  return decode(*in, *out, attrs, shape, ptrs);
}

ffi::Error DecodeForward(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                         const AttentionAttrs& attrs, AttentionShape* shape, ForwardArgs* ptrs) {
  return DecodeFrame<ForwardArgs>(DecodeForward, args, rets, attrs, shape, ptrs);
}

ffi::Error DecodeBackward(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                          const AttentionAttrs& attrs, AttentionShape* shape,
                          BackwardArgs* ptrs) {
  return DecodeFrame<BackwardArgs>(DecodeBackward, args, rets, attrs, shape, ptrs);
}

ffi::Error DecodeListedKeys(ffi::AnyBuffer grad, ffi::AnyBuffer slots, ffi::AnyBuffer spans,
                            ffi::AnyBuffer out, ListedKeysShape* s, ListedKeysArgs* p) {
  const auto gd = grad.dimensions(), kd = slots.dimensions(), sd = spans.dimensions(),
             od = out.dimensions();
  const size_t lead = kd.size() < 3 ? 0 : kd.size() - 3;
  auto shapes = [&] {
    return DimsString(gd) + DimsString(kd) + DimsString(sd) + DimsString(od);
  };
  if (kd.size() < 3 || gd.size() != lead + 4 || sd.size() != lead + 3 ||
      od.size() != lead + 3) {
    return Invalid("listed keys: grad [*B, nb, U, C, D], slots [*B, Cc, nb, Lk], spans "
                   "[*B, Cc, 2, Lk], out [*B, Lk, C, D] expected, got " + shapes());
  }
  s->batch = 1;
  for (size_t d = 0; d < lead; ++d) {
    if (gd[d] != kd[d] || sd[d] != kd[d] || od[d] != kd[d]) {
      return Invalid("listed keys: leading dims differ: " + shapes());
    }
    s->batch *= kd[d];
  }
  s->blocks = gd[lead];
  s->slots = gd[lead + 1];
  s->channels = gd[lead + 2];
  s->dim = gd[lead + 3];
  s->key_channels = kd[lead];
  s->seqlen_k = od[lead];
  const bool ok = kd[lead + 1] == s->blocks && kd[lead + 2] == s->seqlen_k &&
                  (s->key_channels == 1 || s->key_channels == s->channels) &&
                  sd[lead] == s->key_channels && sd[lead + 1] == 2 && sd[lead + 2] == s->seqlen_k &&
                  od[lead + 1] == s->channels && od[lead + 2] == s->dim;
  if (!ok) return Invalid("listed keys: inconsistent shapes " + shapes());
  if (slots.element_type() != ffi::DataType::S32 || spans.element_type() != ffi::DataType::S32) {
    return Invalid("listed keys: slots and spans must be int32");
  }
  const auto dtype = AttentionElementType(grad.element_type());
  if (dtype.has_error()) return Invalid("listed keys: grad must be float32, float16 or bfloat16");
  if (auto e = ExpectSameType(out, grad.element_type(), "out"); e.failure()) return e;
  s->dtype = *dtype;
  p->grad = grad.untyped_data();
  p->slots = static_cast<const int32_t*>(slots.untyped_data());
  p->spans = static_cast<const int32_t*>(spans.untyped_data());
  p->out = out.untyped_data();
  return ffi::Error::Success();
}

bool IsMaskBitsOf(ffi::AnyBuffer::Dimensions bits, ffi::AnyBuffer::Dimensions mask) {
  if (mask.size() < 2 || bits.size() != mask.size()) return false;
  for (size_t d = 0; d + 1 < mask.size(); ++d) {
    if (bits[d] != mask[d]) return false;
  }
  return bits[mask.size() - 1] == MaskBitsRowBytes(mask[mask.size() - 1]);
}

bool IsMaskMapOf(ffi::AnyBuffer::Dimensions map, ffi::AnyBuffer::Dimensions mask) {
  if (mask.size() < 2 || map.size() != mask.size()) return false;
  for (size_t d = 0; d < mask.size(); ++d) {
    const bool cell_dim = d + 2 >= mask.size();
    if (map[d] != (cell_dim ? (mask[d] + kMaskMapCell - 1) / kMaskMapCell : mask[d])) return false;
  }
  return true;
}

}  // namespace dmattn
