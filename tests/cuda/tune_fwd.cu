// Variant counts for tests/cuda/run_gpu.sh TUNE=1 (kernel_check --variants checks and times
// DMATTN_CUDA_VARIANT=1..n next to the library's tiles; see launch_template.cuh), and the forward
// variants. Not part of the library.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {

using BF16 = __nv_bfloat16;

int TuningVariants(bool backward, int head_dim) {
  if (backward) return head_dim == 128 ? 7 : (head_dim == 64 ? 2 : 0);
  return head_dim == 128 ? 4 : (head_dim == 64 ? 1 : 0);
}

// 1: 64-row tiles.
template <>
cudaError_t RunForwardVariant<64, BF16>(int v, const FwdParams& p, cudaStream_t stream) {
  return v == 1 ? RunForwardTiles<FwdTraits<64, 64, 64, 4>, BF16>(p, stream)
                : cudaErrorNotSupported;
}

// 1: 128 x 64 (32 rows per warp; spills); 2: 64 x 64. The library's 64 x 128 beat both on every
// harness benchmark on the H200, and 8 warps of 16 rows at 128 x 64 or 128 x 128 were slower.
// 3: the library's tile on mma.sync (what sm_80 runs); 4: 64 x 64 (wgmma on sm_90a).
template <>
cudaError_t RunForwardVariant<128, BF16>(int v, const FwdParams& p, cudaStream_t stream) {
  switch (v) {
    case 1: return RunForwardTiles<FwdTraits<128, 128, 64, 4>, BF16>(p, stream);
    case 2: return RunForwardTiles<FwdTraits<128, 64, 64, 4, false>, BF16>(p, stream);
    case 3: return RunForwardTiles<FwdTraits<128, 64, 128, 4, false>, BF16>(p, stream);
    case 4: return RunForwardTiles<FwdTraits<128, 64, 64, 4>, BF16>(p, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace dmattn::cuda
