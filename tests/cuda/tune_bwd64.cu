// Backward variants at head dim 64 for tests/cuda/run_gpu.sh TUNE=1 (DMATTN_CUDA_VARIANT=<n>;
// see launch_template.cuh): 1 = the sm_80 tile on mma.sync (what Hopper ran before the wgmma
// tiles), 2 = the 128-key wgmma tile with one Q/dO stage, 3 / 4 = the library's 64-key / 128-key
// wgmma tile for every grid. Not part of the library.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {

using BF16 = __nv_bfloat16;

template <>
cudaError_t RunBackwardVariant<64, BF16>(int v, const BwdLaunch& l, cudaStream_t st) {
  using Cfg = BwdConfigSm90<64>;
  using Dq = Cfg::DqTraits;
  switch (v) {
    case 1: return RunBackwardTiles<BwdTraits<64, 128, 64, 8, 4, 4, 4, 2>, Dq, BF16>(l, st);
    case 2: return RunBackwardTiles<BwdTraits<64, 128, 64, 8, 8, 8, 4, 1>, Dq, BF16>(l, st);
    case 3: return RunBackwardTiles<Cfg::Narrow, Dq, BF16>(l, st);
    case 4: return RunBackwardTiles<Cfg::Traits, Dq, BF16>(l, st);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace dmattn::cuda
