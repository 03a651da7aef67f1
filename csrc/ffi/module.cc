// The Python extension: handler capsules per platform and a few facts about this build.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <type_traits>
#include <vector>

#include "ffi/handlers.h"

namespace nb = nanobind;

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

}  // namespace

NB_MODULE(_dmattn, m) {
  m.doc() = "jax_dmattn XLA FFI handlers";
  m.def("registrations", &Registrations,
        "Handler capsules by platform: {platform: {target name: capsule}}.");
  m.def("build_info", &BuildInfo, "Facts about the compiled kernels.");
}
