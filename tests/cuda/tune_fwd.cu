// Variant counts for tests/cuda/run_gpu.sh TUNE=1 (kernel_check --variants checks and times
// DMATTN_CUDA_VARIANT=1..n next to the library's tiles; see launch_template.cuh), and the forward
// variants (none at present). Not part of the library.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {

using BF16 = __nv_bfloat16;

int TuningVariants(bool backward, int head_dim) {
  if (backward) return head_dim == 128 ? 3 : (head_dim == 64 ? 2 : 0);
  return 0;
}

template <>
cudaError_t RunForwardVariant<64, BF16>(int, const FwdParams&, cudaStream_t) {
  return cudaErrorNotSupported;
}

template <>
cudaError_t RunForwardVariant<128, BF16>(int, const FwdParams&, cudaStream_t) {
  return cudaErrorNotSupported;
}

}  // namespace dmattn::cuda
