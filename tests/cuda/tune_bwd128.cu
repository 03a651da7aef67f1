// Backward variants at head dim 128 for tests/cuda/run_gpu.sh TUNE=1 (DMATTN_CUDA_VARIANT=<n>;
// see launch_template.cuh): 1 / 2 = the wide / narrow tile whatever the grid size, 3 = the narrow
// tile with one Q/dO stage. Not part of the library.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {

using BF16 = __nv_bfloat16;

template <>
cudaError_t RunBackwardVariant<128, BF16>(int v, const BwdLaunch& l, cudaStream_t st) {
  using Cfg = BwdConfig<128>;
  switch (v) {
    case 1: return RunBackwardTiles<Cfg::Traits, Cfg::DqTraits, BF16>(l, st);
    case 2: return RunBackwardTiles<Cfg::Narrow, Cfg::DqTraits, BF16>(l, st);
    case 3:
      return RunBackwardTiles<BwdTraits<128, 64, 64, 8, 4, 4, 4, 1>, Cfg::DqTraits, BF16>(l, st);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace dmattn::cuda
