// Decoding of an FFI call frame into the one params struct, for both platforms.
//
// Operand order (mirrored by jax_dmattn/_primitives/_ffi.py):
//   forward  args: q, k, v, [page_table], [mask], [bias], [q_lens, kv_lens], [q_segments, kv_segments],
//                  [key_start, key_end], [row_start, row_end], [block_indices],
//                  [alpha, delta], [mask_map, mask_bits]
//            rets: out, lse, [drop_map], [platform workspaces]
//   backward args: q, k, v, out, dout, lse, dlse, [mask], [bias], [q_lens, kv_lens],
//                  [q_segments, kv_segments], [key_start, key_end], [row_start, row_end],
//                  [block_indices], [alpha, delta], [drop_map], [mask_map, mask_bits]
//            rets: dq, dk, dv, [dbias], [dalpha, ddelta], softmax_d, [platform workspaces]
// page_table: with page_size > 0, k and v are pools [num_pages, page_size, Hk, D] read through it
// (common/params.h: KvPages); kv_lens are required then.
// mask_map, mask_bits: the CUDA kernels' mask block map and bit-packed mask (cuda/attention.h),
// which they need with a mask.
#pragma once

#include <cstdint>
#include <vector>

#include "common/params.h"
#include "xla/ffi/api/ffi.h"

namespace dmattn {

// The call's attributes; one FFI dictionary decoded as a struct.
struct AttentionAttrs {
  float scale;
  float softcap;
  int64_t diagonal_offset;
  int64_t window_left;
  int64_t window_right;
  // Per-kv-head windows with sinks, [Hk, 3] row-major (sink, left, right); empty without.
  xla::ffi::Span<const int64_t> window_sizes;
  bool has_mask;
  bool has_bias;
  bool has_seqlens;
  bool has_segments;
  bool has_key_ranges;
  bool has_row_ranges;
  bool has_block_indices;
  int64_t block_q;  // the block indices' block sizes (0 without them)
  int64_t block_k;
  bool deterministic;
  bool has_gate;    // alpha, delta operands (and dalpha, ddelta results)
  double gate_cut;  // the gate threshold as a product alpha * delta; -inf: none
  // Softmax-threshold skipping (> 0; 0: off): the forward's drop_map result, the backward's
  // drop_map operand.
  double softmax_threshold;
  // A paged k and v (forward only): the pool's page size, a power of two >= kMinPageSize; 0:
  // contiguous.
  int64_t page_size;
};

// A call's operands or results, in the order above.
using Buffers = std::vector<xla::ffi::AnyBuffer>;

xla::ffi::Error DecodeForward(const Buffers& args, const Buffers& rets,
                              const AttentionAttrs& attrs, AttentionShape* shape,
                              ForwardArgs* ptrs);

xla::ffi::Error DecodeBackward(const Buffers& args, const Buffers& rets,
                               const AttentionAttrs& attrs, AttentionShape* shape,
                               BackwardArgs* ptrs);

// The same, for a handler's call frame.
xla::ffi::Error DecodeForward(const xla::ffi::RemainingArgs& args,
                              const xla::ffi::RemainingRets& rets, const AttentionAttrs& attrs,
                              AttentionShape* shape, ForwardArgs* ptrs);
xla::ffi::Error DecodeBackward(const xla::ffi::RemainingArgs& args,
                               const xla::ffi::RemainingRets& rets, const AttentionAttrs& attrs,
                               AttentionShape* shape, BackwardArgs* ptrs);

// True when `map` has the dims of the CUDA mask block map (cuda/attention.h) of a mask with dims
// `mask`: the same, the last two divided by kMaskMapCell and rounded up.
bool IsMaskMapOf(xla::ffi::AnyBuffer::Dimensions map, xla::ffi::AnyBuffer::Dimensions mask);
// True when `bits` has the dims of the CUDA bit-packed mask of a mask with dims `mask`: the
// same, the last one MaskBitsRowBytes of it.
bool IsMaskBitsOf(xla::ffi::AnyBuffer::Dimensions bits, xla::ffi::AnyBuffer::Dimensions mask);

// The listed-keys gradient sum (common/params.h, ListedKeysShape): args grad, slots, spans;
// ret out.
xla::ffi::Error DecodeListedKeys(xla::ffi::AnyBuffer grad, xla::ffi::AnyBuffer slots,
                                 xla::ffi::AnyBuffer spans, xla::ffi::AnyBuffer out,
                                 ListedKeysShape* shape, ListedKeysArgs* ptrs);

}  // namespace dmattn

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::dmattn::AttentionAttrs, ::xla::ffi::StructMember<float>("scale"),
    ::xla::ffi::StructMember<float>("softcap"),
    ::xla::ffi::StructMember<int64_t>("diagonal_offset"),
    ::xla::ffi::StructMember<int64_t>("window_left"),
    ::xla::ffi::StructMember<int64_t>("window_right"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("window_sizes"),
    ::xla::ffi::StructMember<bool>("has_mask"), ::xla::ffi::StructMember<bool>("has_bias"),
    ::xla::ffi::StructMember<bool>("has_seqlens"), ::xla::ffi::StructMember<bool>("has_segments"),
    ::xla::ffi::StructMember<bool>("has_key_ranges"),
    ::xla::ffi::StructMember<bool>("has_row_ranges"),
    ::xla::ffi::StructMember<bool>("has_block_indices"),
    ::xla::ffi::StructMember<int64_t>("block_q"), ::xla::ffi::StructMember<int64_t>("block_k"),
    ::xla::ffi::StructMember<bool>("deterministic"), ::xla::ffi::StructMember<bool>("has_gate"),
    ::xla::ffi::StructMember<double>("gate_cut"),
    ::xla::ffi::StructMember<double>("softmax_threshold"),
    ::xla::ffi::StructMember<int64_t>("page_size"));
