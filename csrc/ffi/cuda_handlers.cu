// CUDA FFI handlers: decode the call, launch on XLA's stream. Never synchronises; any CUDA error
// comes back as an FFI error carrying CUDA's message.
#include <string>

#include "cuda/attention.h"
#include "cuda/dynamic.h"
#include "ffi/decode.h"
#include "ffi/handlers.h"

namespace dmattn {
namespace ffi = xla::ffi;

namespace {

ffi::Error CheckSupported(const AttentionShape& shape, const uint8_t* mask_map,
                          const uint8_t* mask_bits) {
  if (shape.dtype == ElementType::kFloat32) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: CUDA kernels take float16 or bfloat16, not float32");
  }
  if (!cuda::SupportsHeadDim(shape.head_dim)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: no CUDA kernel compiled for head dim " +
                          std::to_string(shape.head_dim));
  }
  if (!cuda::SupportsHeadWindows(shape)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: the CUDA kernels take window tables (window_sizes) of at most " +
                          std::to_string(kMaxWindowHeads) + " kv heads, not " +
                          std::to_string(shape.num_kv_heads));
  }
  if (shape.softmax_threshold > 0.0 && std::string(cuda::ForwardKernelName(shape)) == "none") {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: the CUDA kernels take softmax_threshold (tile skipping) at "
                      "head dims 64 and 128, without a gate threshold");
  }
  if (shape.pages.present() && std::string(cuda::ForwardKernelName(shape)) != "decode") {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: only the CUDA decode forward reads a paged cache, and it does "
                      "not take this call (the front end gathers the pages of such calls)");
  }
  if (shape.mask.present && (mask_map == nullptr || mask_bits == nullptr)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: a CUDA call with a mask needs its mask_map and mask_bits "
                      "operands");
  }
  return ffi::Error::Success();
}

ffi::Error CudaStatus(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_dmattn: CUDA error in ") + what + ": " +
                              cudaGetErrorString(status));
}

ffi::Error CudaForward(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       AttentionAttrs attrs) {
  AttentionShape shape;
  ForwardArgs ptrs;
  if (auto e = DecodeForward(args, rets, attrs, &shape, &ptrs); e.failure()) return e;
  if (auto e = CheckSupported(shape, ptrs.mask_map, ptrs.mask_bits); e.failure()) return e;
  return CudaStatus(cuda::Forward(shape, ptrs, stream), "forward");
}

ffi::Error CudaBackward(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        AttentionAttrs attrs) {
  AttentionShape shape;
  BackwardArgs ptrs;
  if (auto e = DecodeBackward(args, rets, attrs, &shape, &ptrs); e.failure()) return e;
  if (auto e = CheckSupported(shape, ptrs.mask_map, ptrs.mask_bits); e.failure()) return e;
  return CudaStatus(cuda::Backward(shape, ptrs, stream), "backward");
}

ffi::Error CudaMaskMap(cudaStream_t stream, ffi::Buffer<ffi::PRED> mask,
                       ffi::ResultBuffer<ffi::U8> map, ffi::ResultBuffer<ffi::U8> bits,
                       int64_t diagonal_offset,
                       int64_t window_left, int64_t window_right) {
  const auto md = mask.dimensions();
  if (!IsMaskMapOf(map->dimensions(), md) || !IsMaskBitsOf(bits->dimensions(), md)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: mask_map takes a mask [..., R, C] and returns uint8 "
                      "[..., ceil(R / cell), ceil(C / cell)], cell = " +
                          std::to_string(kMaskMapCell) +
                          ", and uint8 [..., R, ceil(C / 128) * 16] (the bits)");
  }
  const size_t rank = md.size();
  int64_t entries = 1;
  for (size_t d = 0; d + 2 < rank; ++d) entries *= md[d];
  AttentionShape rule;
  rule.diagonal_offset = diagonal_offset;
  rule.window_left = window_left;
  rule.window_right = window_right;
  return CudaStatus(cuda::BuildMaskBlockMap(mask.typed_data(), entries, md[rank - 2],
                                            md[rank - 1], rule, map->typed_data(),
                                            bits->typed_data(), stream),
                    "mask_map");
}

ffi::Error CudaTopkLeave(cudaStream_t stream, ffi::Buffer<ffi::S32> key,
                         ffi::ResultBuffer<ffi::S32> leave, int64_t window) {
  const auto dims = key.dimensions();
  if (dims.size() != 2 || leave->dimensions().size() != 2 || leave->dimensions()[0] != dims[0] ||
      leave->dimensions()[1] != dims[1]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: topk_leave takes key and leave of one shape [rows, Lk]");
  }
  if (window < 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_dmattn: topk_leave needs window >= 1");
  }
  return CudaStatus(
      cuda::TopkLeave(key.typed_data(), leave->typed_data(), dims[0], dims[1], window, stream),
      "topk_leave");
}

ffi::Error CudaRangeMask(cudaStream_t stream, ffi::Buffer<ffi::S32> first,
                         ffi::Buffer<ffi::S32> end, ffi::ResultBuffer<ffi::PRED> mask,
                         int64_t block) {
  const auto fd = first.dimensions(), ed = end.dimensions(), md = mask->dimensions();
  const size_t rank = fd.size();  // [..., nb, U] -> [..., nb, block, U]
  bool ok = rank >= 2 && ed.size() == rank && md.size() == rank + 1 && block >= 1 &&
            ed[rank - 1] == fd[rank - 1] && md[rank - 1] == block && md[rank] == fd[rank - 1];
  int64_t groups = 1;  // every (..., n)
  for (size_t d = 0; ok && d + 1 < rank; ++d) {
    ok = ed[d] == fd[d] && md[d] == fd[d];
    groups *= fd[d];
  }
  if (!ok) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_dmattn: range_mask takes first and end [..., nb, U] and returns "
                      "mask [..., nb, block, U]");
  }
  return CudaStatus(cuda::RangeMask(first.typed_data(), end.typed_data(), mask->typed_data(),
                                    groups, fd[rank - 2], block, fd[rank - 1], stream),
                    "range_mask");
}

ffi::Error CudaSumListedKeys(cudaStream_t stream, ffi::AnyBuffer grad, ffi::AnyBuffer slots,
                             ffi::AnyBuffer spans, ffi::Result<ffi::AnyBuffer> out) {
  ListedKeysShape shape;
  ListedKeysArgs ptrs;
  if (auto e = DecodeListedKeys(grad, slots, spans, *out, &shape, &ptrs); e.failure()) return e;
  return CudaStatus(cuda::SumListedKeys(shape, ptrs, stream), "sum_listed_keys");
}

// Every CUDA handler runs on XLA's stream; the attention ones decode their operands themselves.
auto OnStream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
auto AttentionBinding() {
  return OnStream().RemainingArgs().RemainingRets().Attrs<AttentionAttrs>();
}
constexpr auto kCmdBuffer = ffi::Traits::kCmdBufferCompatible;

}  // namespace
}  // namespace dmattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnForwardCuda, dmattn::CudaForward, dmattn::AttentionBinding(),
                              {dmattn::kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnBackwardCuda, dmattn::CudaBackward,
                              dmattn::AttentionBinding(), {dmattn::kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnMaskMapCuda, dmattn::CudaMaskMap,
                              dmattn::OnStream()
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Attr<int64_t>("diagonal_offset")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right"),
                              {dmattn::kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnTopkLeaveCuda, dmattn::CudaTopkLeave,
                              dmattn::OnStream()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int64_t>("window"),
                              {dmattn::kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnRangeMaskCuda, dmattn::CudaRangeMask,
                              dmattn::OnStream()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Attr<int64_t>("block"),
                              {dmattn::kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnSumListedKeysCuda, dmattn::CudaSumListedKeys,
                              dmattn::OnStream()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {dmattn::kCmdBuffer});
