// The Python extension: handler capsules per platform and a few facts about this build.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <deque>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "ffi/decode.h"
#include "ffi/handlers.h"
#if defined(DMATTN_WITH_CUDA)
#include "cuda/attention.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>);
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict cpu;
  cpu["dmattn_fwd"] = Capsule(DmattnForwardCpu);
  cpu["dmattn_bwd"] = Capsule(DmattnBackwardCpu);
  cpu["dmattn_sum_listed_keys"] = Capsule(DmattnSumListedKeysCpu);
  nb::dict platforms;
  platforms["cpu"] = cpu;
#if defined(DMATTN_WITH_CUDA)
  nb::dict cuda;
  cuda["dmattn_fwd"] = Capsule(DmattnForwardCuda);
  cuda["dmattn_bwd"] = Capsule(DmattnBackwardCuda);
  cuda["dmattn_mask_map"] = Capsule(DmattnMaskMapCuda);
  cuda["dmattn_topk_leave"] = Capsule(DmattnTopkLeaveCuda);
  cuda["dmattn_range_mask"] = Capsule(DmattnRangeMaskCuda);
  cuda["dmattn_sum_listed_keys"] = Capsule(DmattnSumListedKeysCuda);
  platforms["CUDA"] = cuda;
#endif
  return platforms;
}

nb::dict BuildInfo() {
  nb::dict info;
  // The FFI API version the handlers were compiled against: a jaxlib older than it refuses them.
  info["xla_ffi_api"] = std::vector<int>{XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  info["segments"] = true;  // the CPU kernels read segment ids
  info["key_ranges"] = true;  // and key ranges
  info["row_ranges"] = true;  // and row ranges
  info["block_indices"] = true;  // and block indices
  info["window_sizes"] = true;  // and per-kv-head windows with sinks
  // and the gate of gated attention, with its threshold
  info["gate"] = true;
  // and softmax-threshold tile skipping (the CUDA kernels do not)
  info["softmax_threshold"] = true;
  info["min_page_size"] = dmattn::kMinPageSize;  // a paged cache's pages: powers of two
#if defined(DMATTN_WITH_CUDA)
  info["cuda"] = true;
  info["cuda_head_dims"] = std::vector<int>{DMATTN_CUDA_HEAD_DIMS};
  info["cuda_archs"] = std::string(DMATTN_CUDA_ARCHS);
  info["cuda_dtypes"] = std::string(DMATTN_CUDA_DTYPES);
  info["mask_map_cell"] = dmattn::kMaskMapCell;
  info["cuda_segments"] = true;  // so do the CUDA kernels
  info["cuda_index_masks"] = true;  // and key ranges, row ranges and block indices
  info["cuda_window_heads"] = dmattn::kMaxWindowHeads;  // window tables of at most so many kv heads
#else
  info["cuda"] = false;
  info["cuda_head_dims"] = std::vector<int>{};
  info["cuda_archs"] = std::string();
  info["cuda_dtypes"] = std::string();
#endif
  return info;
}

#if defined(DMATTN_WITH_CUDA)
// Shape-only buffers (no data) so that trace-time workspace sizes come from the handlers' own
// decoding: the size Python asks for and the kernels' rule cannot disagree.
class ShapeOnlyBuffers {
 public:
  xla::ffi::AnyBuffer Add(std::vector<int64_t> dims, XLA_FFI_DataType type) {
    dims_.push_back(std::move(dims));
    buffers_.push_back(XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, type, nullptr,
                                      static_cast<int64_t>(dims_.back().size()),
                                      dims_.back().data()});
    return xla::ffi::AnyBuffer(&buffers_.back());
  }
  // [*batch, H, Lq] for q [*batch, Lq, H, D].
  xla::ffi::AnyBuffer AddLse(const std::vector<int64_t>& q) {
    std::vector<int64_t> lse(q.begin(), q.end() - 3);
    lse.push_back(q[q.size() - 2]);
    lse.push_back(q[q.size() - 3]);
    return Add(std::move(lse), XLA_FFI_DataType_F32);
  }

 private:
  std::deque<std::vector<int64_t>> dims_;  // deques: stable addresses
  std::deque<XLA_FFI_Buffer> buffers_;
};

void ThrowOnError(const xla::ffi::Error& e) {
  if (e.failure()) throw std::invalid_argument(e.message());
}

using OptionalDims = std::optional<std::vector<int64_t>>;

// The index-mask operands of a call, by the dims the kernels see (nullopt: absent): segment ids
// (int32 [*batch|1, Lq] and [*batch|1, Lk]), key ranges (key_start's dims, [*batch|1, H|Hk|1, 1,
// Lk]; key_end has the same), row ranges (row_start's, [*batch|1, H|Hk|1, Lq, 1]) and block
// indices ([*batch|1, H|Hk|1, ceil(Lq / block_q), K]) with their block sizes; and the gate
// (alpha [*batch, Lq, H], delta [*batch, Lk, Hk]) with its threshold's cut (the kernels'
// workspace holds the threshold's bounds beside the index masks' summaries).
struct IndexMaskDims {
  OptionalDims q_segments, kv_segments, key_ranges, row_ranges, block_indices;
  int64_t block_q = 0, block_k = 0;
  OptionalDims alpha, delta;
  double gate_cut = -INFINITY;
};

// Appends the index-mask and gate operands of a shape-only call in decode.h's order (after the
// lengths) and sets their flags, block sizes and cut in `attrs`, so that the decoded shape
// carries them.
void AddIndexMasks(ShapeOnlyBuffers& b, dmattn::Buffers& args, const IndexMaskDims& m,
                   dmattn::AttentionAttrs* attrs) {
  if (m.q_segments.has_value() != m.kv_segments.has_value()) {
    throw std::invalid_argument("q_segments and kv_segments go together");
  }
  attrs->has_segments = m.q_segments.has_value();
  if (attrs->has_segments) {
    args.push_back(b.Add(*m.q_segments, XLA_FFI_DataType_S32));
    args.push_back(b.Add(*m.kv_segments, XLA_FFI_DataType_S32));
  }
  // A pair of ranges has one shape: one shape-only buffer stands for its start and its end.
  attrs->has_key_ranges = m.key_ranges.has_value();
  if (attrs->has_key_ranges) {
    args.insert(args.end(), 2, b.Add(*m.key_ranges, XLA_FFI_DataType_S32));
  }
  attrs->has_row_ranges = m.row_ranges.has_value();
  if (attrs->has_row_ranges) {
    args.insert(args.end(), 2, b.Add(*m.row_ranges, XLA_FFI_DataType_S32));
  }
  attrs->has_block_indices = m.block_indices.has_value();
  if (attrs->has_block_indices) {
    args.push_back(b.Add(*m.block_indices, XLA_FFI_DataType_S32));
    attrs->block_q = m.block_q;
    attrs->block_k = m.block_k;
  }
  if (m.alpha.has_value() != m.delta.has_value()) {
    throw std::invalid_argument("alpha and delta go together");
  }
  attrs->has_gate = m.alpha.has_value();
  if (attrs->has_gate) {
    args.push_back(b.Add(*m.alpha, XLA_FFI_DataType_F32));
    args.push_back(b.Add(*m.delta, XLA_FFI_DataType_F32));
    attrs->gate_cut = m.gate_cut;
  }
}

// The attributes of a shape-only call: no window, no softcap; optional operands absent until
// their flags are set.
dmattn::AttentionAttrs ShapeOnlyAttrs() {
  dmattn::AttentionAttrs attrs{};
  attrs.scale = 1.f;
  attrs.window_left = -1;
  attrs.window_right = -1;
  return attrs;
}

// Bytes of the CUDA backward's workspace 1 (the index masks' summaries, the key-block order, a
// dbias accumulator when one is needed, the dQ turn flags of a deterministic call) for a call
// with these shapes; `bias` and `dbias` empty for a call without a bias.
int64_t CudaBackwardWorkspaceBytes(std::vector<int64_t> q, std::vector<int64_t> k,
                                   std::vector<int64_t> dk, std::vector<int64_t> bias,
                                   std::vector<int64_t> dbias, OptionalDims q_segments,
                                   OptionalDims kv_segments, OptionalDims key_ranges,
                                   OptionalDims row_ranges, OptionalDims block_indices,
                                   int64_t block_q, int64_t block_k, OptionalDims alpha,
                                   OptionalDims delta, double gate_cut, bool deterministic) {
  const IndexMaskDims index_masks{q_segments, kv_segments, key_ranges, row_ranges, block_indices,
                                  block_q,    block_k,     alpha,      delta,      gate_cut};
  ShapeOnlyBuffers b;
  dmattn::AttentionAttrs attrs = ShapeOnlyAttrs();
  attrs.has_bias = !bias.empty();
  attrs.deterministic = deterministic;
  const auto qb = b.Add(q, XLA_FFI_DataType_BF16), kb = b.Add(k, XLA_FFI_DataType_BF16),
             lseb = b.AddLse(q), dkb = b.Add(dk, XLA_FFI_DataType_BF16);
  dmattn::Buffers args = {qb, kb, kb, qb, qb, lseb, lseb};
  dmattn::Buffers rets = {qb, dkb, dkb};
  if (attrs.has_bias) {
    args.push_back(b.Add(bias, XLA_FFI_DataType_BF16));
    rets.push_back(b.Add(dbias, XLA_FFI_DataType_BF16));
  }
  AddIndexMasks(b, args, index_masks, &attrs);
  if (attrs.has_gate) {  // dalpha, ddelta
    rets.push_back(b.Add(*alpha, XLA_FFI_DataType_F32));
    rets.push_back(b.Add(*delta, XLA_FFI_DataType_F32));
  }
  rets.push_back(lseb);
  dmattn::AttentionShape shape;
  dmattn::BackwardArgs ptrs;
  ThrowOnError(dmattn::DecodeBackward(args, rets, attrs, &shape, &ptrs));
  return dmattn::cuda::BackwardWorkspaceBytes(shape);
}

// The shape a CUDA forward call with these q and k (and mask, bias and index-mask) shapes
// decodes to.
dmattn::AttentionShape ForwardShape(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                    const OptionalDims& mask = {}, const OptionalDims& bias = {},
                                    const IndexMaskDims& index_masks = {}) {
  ShapeOnlyBuffers b;
  dmattn::AttentionAttrs attrs = ShapeOnlyAttrs();
  attrs.has_mask = mask.has_value();
  attrs.has_bias = bias.has_value();
  const auto qb = b.Add(q, XLA_FFI_DataType_BF16), kb = b.Add(k, XLA_FFI_DataType_BF16);
  dmattn::Buffers args = {qb, kb, kb};
  if (mask) args.push_back(b.Add(*mask, XLA_FFI_DataType_PRED));
  if (bias) args.push_back(b.Add(*bias, XLA_FFI_DataType_BF16));
  AddIndexMasks(b, args, index_masks, &attrs);
  const dmattn::Buffers rets = {qb, b.AddLse(q)};
  dmattn::AttentionShape shape;
  dmattn::ForwardArgs ptrs;
  ThrowOnError(dmattn::DecodeForward(args, rets, attrs, &shape, &ptrs));
  return shape;
}

// Key splits of the CUDA forward on the current device, and the bytes of its workspace 0 (the
// index masks' summaries, the query-block order and the splits' partial results).
int64_t CudaForwardSplits(std::vector<int64_t> q, std::vector<int64_t> k) {
  return dmattn::cuda::ForwardSplits(ForwardShape(q, k));
}
int64_t CudaForwardWorkspaceBytes(std::vector<int64_t> q, std::vector<int64_t> k,
                                  OptionalDims q_segments, OptionalDims kv_segments,
                                  OptionalDims key_ranges, OptionalDims row_ranges,
                                  OptionalDims block_indices, int64_t block_q, int64_t block_k,
                                  OptionalDims alpha, OptionalDims delta, double gate_cut) {
  const IndexMaskDims index_masks{q_segments, kv_segments, key_ranges, row_ranges, block_indices,
                                  block_q,    block_k,     alpha,      delta,      gate_cut};
  return dmattn::cuda::ForwardWorkspaceBytes(ForwardShape(q, k, {}, {}, index_masks));
}

// The forward kernel a CUDA call with these shapes (and index masks) runs on the current device.
std::string CudaForwardKernel(std::vector<int64_t> q, std::vector<int64_t> k, OptionalDims mask,
                              OptionalDims bias, OptionalDims q_segments, OptionalDims kv_segments,
                              OptionalDims key_ranges, OptionalDims row_ranges,
                              OptionalDims block_indices, int64_t block_q, int64_t block_k,
                              OptionalDims alpha, OptionalDims delta, double gate_cut,
                              float softcap, double softmax_threshold) {
  const IndexMaskDims index_masks{q_segments, kv_segments, key_ranges, row_ranges, block_indices,
                                  block_q,    block_k,     alpha,      delta,      gate_cut};
  dmattn::AttentionShape shape = ForwardShape(q, k, mask, bias, index_masks);
  shape.softcap = softcap;
  shape.softmax_threshold = softmax_threshold;
  return dmattn::cuda::ForwardKernelName(shape);
}

void CudaSetForwardKernel(const std::string& name) {
  using dmattn::cuda::ForwardKernel;
  if (name == "auto") {
    dmattn::cuda::SetForwardKernel(ForwardKernel::kAuto);
  } else if (name == "flash2") {
    dmattn::cuda::SetForwardKernel(ForwardKernel::kFlash2);
  } else {
    throw std::invalid_argument("forward kernel must be 'auto' or 'flash2', not '" + name + "'");
  }
}

void CudaSetBackwardKernel(const std::string& name) {
  using dmattn::cuda::BackwardKernel;
  if (name == "auto") {
    dmattn::cuda::SetBackwardKernel(BackwardKernel::kAuto);
  } else if (name == "flash2") {
    dmattn::cuda::SetBackwardKernel(BackwardKernel::kFlash2);
  } else {
    throw std::invalid_argument("backward kernel must be 'auto' or 'flash2', not '" + name + "'");
  }
}
#endif

}  // namespace

NB_MODULE(_dmattn, m) {
  m.doc() = "jax_dmattn XLA FFI handlers";
  m.def("registrations", &Registrations,
        "Handler capsules by platform: {platform: {target name: capsule}}.");
  m.def("build_info", &BuildInfo, "Facts about the compiled kernels.");
#if defined(DMATTN_WITH_CUDA)
  // The index-mask operands by their dims (None: absent): q_segments and kv_segments,
  // key_ranges (key_start's), row_ranges (row_start's), block_indices with block_q and block_k.
  m.def("cuda_backward_workspace_bytes", &CudaBackwardWorkspaceBytes, "q"_a, "k"_a, "dk"_a,
        "bias"_a, "dbias"_a, "q_segments"_a.none() = nb::none(),
        "kv_segments"_a.none() = nb::none(), "key_ranges"_a.none() = nb::none(),
        "row_ranges"_a.none() = nb::none(), "block_indices"_a.none() = nb::none(),
        "block_q"_a = 0, "block_k"_a = 0, "alpha"_a.none() = nb::none(),
        "delta"_a.none() = nb::none(), "gate_cut"_a = -INFINITY, "deterministic"_a = false,
        "Bytes of the CUDA backward's workspace 1 (index-mask summaries and gate bounds, "
        "key-block order, dbias accumulator, deterministic dQ turn flags).");
  m.def("cuda_forward_splits", &CudaForwardSplits, "q"_a, "k"_a,
        "Key splits of the CUDA forward (1: none) on the current device.");
  m.def("cuda_forward_workspace_bytes", &CudaForwardWorkspaceBytes, "q"_a, "k"_a,
        "q_segments"_a.none() = nb::none(), "kv_segments"_a.none() = nb::none(),
        "key_ranges"_a.none() = nb::none(), "row_ranges"_a.none() = nb::none(),
        "block_indices"_a.none() = nb::none(), "block_q"_a = 0, "block_k"_a = 0,
        "alpha"_a.none() = nb::none(), "delta"_a.none() = nb::none(), "gate_cut"_a = -INFINITY,
        "Bytes of the CUDA forward's workspace (index-mask summaries and gate bounds, query-block "
        "order, split-KV partials).");
  m.def("cuda_forward_kernel", &CudaForwardKernel, "q"_a, "k"_a, "mask"_a.none(),
        "bias"_a.none(), "q_segments"_a.none() = nb::none(), "kv_segments"_a.none() = nb::none(),
        "key_ranges"_a.none() = nb::none(), "row_ranges"_a.none() = nb::none(),
        "block_indices"_a.none() = nb::none(), "block_q"_a = 0, "block_k"_a = 0,
        "alpha"_a.none() = nb::none(), "delta"_a.none() = nb::none(), "gate_cut"_a = -INFINITY,
        "softcap"_a = 0.f, "softmax_threshold"_a = 0.0,
        "The CUDA forward kernel for these shapes on the current device: 'decode', 'hopper', "
        "'flash2' or 'flash2_split', or 'none' (a softmax threshold that no kernel takes).");
  m.def("cuda_set_forward_kernel", &CudaSetForwardKernel, "name"_a,
        "'auto' (the dispatcher's choice) or 'flash2' (the FlashAttention-2-class forward "
        "everywhere), for the whole process: side-by-side measurements and tests.");
  m.def("cuda_set_backward_kernel", &CudaSetBackwardKernel, "name"_a,
        "'auto' (the dispatcher's choice) or 'flash2' (the FlashAttention-2-class backward "
        "everywhere), for the whole process: side-by-side measurements and tests.");
#endif
}
