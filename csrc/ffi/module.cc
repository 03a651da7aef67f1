// The Python extension: handler capsules per platform and a few facts about this build.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>
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
  nb::dict platforms;
  platforms["cpu"] = cpu;
#if defined(DMATTN_WITH_CUDA)
  nb::dict cuda;
  cuda["dmattn_fwd"] = Capsule(DmattnForwardCuda);
  cuda["dmattn_bwd"] = Capsule(DmattnBackwardCuda);
  platforms["CUDA"] = cuda;
#endif
  return platforms;
}

nb::dict BuildInfo() {
  nb::dict info;
#if defined(DMATTN_WITH_CUDA)
  info["cuda"] = true;
  info["cuda_head_dims"] = std::vector<int>{DMATTN_CUDA_HEAD_DIMS};
  info["cuda_archs"] = std::string(DMATTN_CUDA_ARCHS);
  info["cuda_dtypes"] = std::string(DMATTN_CUDA_DTYPES);
#else
  info["cuda"] = false;
  info["cuda_head_dims"] = std::vector<int>{};
  info["cuda_archs"] = std::string();
  info["cuda_dtypes"] = std::string();
#endif
  return info;
}

#if defined(DMATTN_WITH_CUDA)
// fp32 elements of the CUDA backward's dbias accumulator (workspace 1) for a call with these
// shapes; 0 when none is needed. Decodes shape-only buffers with the handlers' own decoding, so
// the trace-time size and the kernel's rule cannot disagree.
int64_t CudaDbiasWorkspaceElements(std::vector<int64_t> q, std::vector<int64_t> k,
                                   std::vector<int64_t> dk, std::vector<int64_t> bias,
                                   std::vector<int64_t> dbias) {
  std::vector<int64_t> lse(q.begin(), q.end() - 3);
  lse.push_back(q[q.size() - 2]);
  lse.push_back(q[q.size() - 3]);
  auto buffer = [](std::vector<int64_t>& dims, XLA_FFI_DataType type) {
    return XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, type, nullptr,
                          static_cast<int64_t>(dims.size()), dims.data()};
  };
  const XLA_FFI_Buffer qb = buffer(q, XLA_FFI_DataType_BF16), kb = buffer(k, XLA_FFI_DataType_BF16),
                       dkb = buffer(dk, XLA_FFI_DataType_BF16),
                       lseb = buffer(lse, XLA_FFI_DataType_F32),
                       biasb = buffer(bias, XLA_FFI_DataType_BF16),
                       dbiasb = buffer(dbias, XLA_FFI_DataType_BF16);
  using xla::ffi::AnyBuffer;
  const dmattn::Buffers args = {AnyBuffer(&qb),   AnyBuffer(&kb),   AnyBuffer(&kb),
                                AnyBuffer(&qb),   AnyBuffer(&qb),   AnyBuffer(&lseb),
                                AnyBuffer(&lseb), AnyBuffer(&biasb)};
  const dmattn::Buffers rets = {AnyBuffer(&qb), AnyBuffer(&dkb), AnyBuffer(&dkb),
                                AnyBuffer(&dbiasb), AnyBuffer(&lseb)};
  dmattn::AttentionAttrs attrs{1.f, 0.f, 0, -1, -1, false, true, false, false};
  dmattn::AttentionShape shape;
  dmattn::BackwardArgs ptrs;
  if (auto e = dmattn::DecodeBackward(args, rets, attrs, &shape, &ptrs); e.failure()) {
    throw std::invalid_argument(e.message());
  }
  return dmattn::cuda::BackwardDbiasWorkspaceElements(shape);
}
#endif

}  // namespace

NB_MODULE(_dmattn, m) {
  m.doc() = "jax_dmattn XLA FFI handlers";
  m.def("registrations", &Registrations,
        "Handler capsules by platform: {platform: {target name: capsule}}.");
  m.def("build_info", &BuildInfo, "Facts about the compiled kernels.");
#if defined(DMATTN_WITH_CUDA)
  m.def("cuda_dbias_workspace_elements", &CudaDbiasWorkspaceElements, "q"_a, "k"_a, "dk"_a,
        "bias"_a, "dbias"_a, "fp32 elements of the CUDA backward's dbias accumulator.");
#endif
}
