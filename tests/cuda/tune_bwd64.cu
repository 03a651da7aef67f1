// Backward variants at head dim 64 for tests/cuda/run_gpu.sh TUNE=1 (DMATTN_CUDA_VARIANT=<n>;
// see launch_template.cuh): 1 = the library's tile with one Q/dO stage, 2 = 16-key warp tiles
// (fused S / dP GEMMs), one stage. Not part of the library.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {

using BF16 = __nv_bfloat16;

template <>
cudaError_t RunBackwardVariant<64, BF16>(int v, const BwdLaunch& l, cudaStream_t st) {
  using Dq = BwdConfig<64>::DqTraits;
  switch (v) {
    case 1: return RunBackwardTiles<BwdTraits<64, 128, 64, 8, 4, 4, 4, 1>, Dq, BF16>(l, st);
    case 2: return RunBackwardTiles<BwdTraits<64, 128, 64, 8, 8, 8, 4, 1>, Dq, BF16>(l, st);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace dmattn::cuda
