// Backward variants at head dim 128 for tests/cuda/run_gpu.sh TUNE=1 (DMATTN_CUDA_VARIANT=<n>;
// see launch_template.cuh): 1 / 2 = the sm_80 wide / narrow tile whatever the grid size;
// 3 = the library's sm_90a tiles with two Q/dO stages in the wide one; 4 / 5 = the 64-key
// wgmma tile with two / one stages whatever the grid; 6 = the library's wide tile on
// mma.sync; 7 = the library's wide tile whatever the grid and bias. Earlier warp-grid
// experiments: benchmarks/results/logs/bwd_tiles_h200.md. Not part of the library.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {

using BF16 = __nv_bfloat16;

// The library's sm_90a tiles with two stages in the wide one (which has no room for two
// stages of a per-query bias: those calls take the narrow tile).
struct TwoStageWide : BwdTiles<128, BwdTraits<128, 128, 64, 8, 8, 8, 4, 2>,
                               BwdConfigSm90<128>::Narrow> {
  static bool UseNarrow(const BwdLaunch& l) {
    const bool bias_rows = l.p.bias != nullptr && l.p.s.bias.row_stride != 0;
    return bias_rows || BwdConfigSm90<128>::UseNarrow(l);
  }
};

template <>
cudaError_t RunBackwardVariant<128, BF16>(int v, const BwdLaunch& l, cudaStream_t st) {
  using Dq = BwdConfig<128>::DqTraits;
  switch (v) {  // (1, 2: BwdConfig<128>'s tiles, which are OffHopper there)
    case 1: return RunBackwardTiles<BwdTraits<128, 128, 64, 8, 4, 4, 2, 1>, Dq, BF16>(l, st);
    case 2: return RunBackwardTiles<BwdTraits<128, 64, 64, 8, 2, 4, 4, 2>, Dq, BF16>(l, st);
    case 3: return RunBackwardConfig<TwoStageWide, BF16>(l, st);
    case 4: return RunBackwardTiles<BwdTraits<128, 64, 64, 8, 4, 4, 4, 2>, Dq, BF16>(l, st);
    case 5: return RunBackwardTiles<BwdTraits<128, 64, 64, 8, 4, 4, 4, 1>, Dq, BF16>(l, st);
    case 6:
      return RunBackwardTiles<BwdTraits<128, 128, 64, 8, 8, 8, 4, 1, false>, Dq, BF16>(l, st);
    case 7: return RunBackwardTiles<BwdConfigSm90<128>::Traits, Dq, BF16>(l, st);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace dmattn::cuda
