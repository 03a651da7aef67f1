// Variant counts for tests/cuda/run_gpu.sh TUNE=1 (kernel_check --variants checks and times
// DMATTN_CUDA_VARIANT=1..n next to the library's tiles; see launch_template.cuh), and the forward
// variants. Not part of the library.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {

using BF16 = __nv_bfloat16;

int TuningVariants(bool backward, int head_dim) {
  if (backward) return head_dim == 128 ? 7 : (head_dim == 64 ? 4 : 0);
  return head_dim == 64 ? 1 : (head_dim == 128 ? 3 : 0);
}

// 1: the Hopper forward with two consumer warpgroups (128 query rows, 240 registers each)
// instead of three (192 rows, 160 registers, some spills), where it takes the call (H100
// harness, dense L4k B4 H32: 1.267 vs 1.208 ms).
// (The FlashAttention-2-class tiles tried here before are recorded in csrc/cuda/README.md.)
template <>
cudaError_t RunForwardVariant<64, BF16>(int v, const FwdParams& p, cudaStream_t stream) {
  if (v != 1) return cudaErrorNotSupported;
  // segment ids, window tables: kernels of their own
  if (!sm90::Takes(p) || p.q_segments != nullptr || p.windows.heads > 0) {
    return RunForwardTiles<FwdConfig<64>::Traits, BF16>(p, stream);
  }
  if (p.mask == nullptr && p.bias == nullptr) {
    return sm90::RunForward<sm90::FwdTraits<64, 128, 2>, BF16>(p, stream);
  }
  return sm90::RunForward<sm90::FwdTraits<64, 128, 2, true>, BF16>(p, stream);
}

// D=128, the Hopper forward's setmaxnreg budgets (producer / consumers; the library: 24 / 240,
// 56 / 224 with a bias ring):
// 1: 40 / 232, 2: 32 / 232, 3: 56 / 224. At 24 every spill of the kernel is the producer's (291
// spill instructions with the operand rings, sm_90a bf16; 40 / 232: 127 + 5 in the consumers;
// 56 / 224: 38 + 40); 56 / 224 ran 6 % faster on bias + 50 % mask and 5 % slower on bias + an
// all-true mask (benchmarks/results/hopper_forward_masked_h100.md). Each variant runs the
// library's kernel for the call (a mask alone: no bias ring) with other budgets.
template <int kProducerRegs, int kConsumerRegs, bool kOperands, bool kBias>
using Budgeted128 =
    sm90::FwdTraits<128, 128, 2, kOperands, kProducerRegs, kConsumerRegs, false, kBias>;

template <int kProducerRegs, int kConsumerRegs>
cudaError_t RunHopperForward128(const FwdParams& p, cudaStream_t stream) {
  if (p.mask == nullptr && p.bias == nullptr) {
    return sm90::RunForward<Budgeted128<kProducerRegs, kConsumerRegs, false, false>, BF16>(p,
                                                                                        stream);
  }
  return p.bias != nullptr
             ? sm90::RunForward<Budgeted128<kProducerRegs, kConsumerRegs, true, true>, BF16>(p,
                                                                                          stream)
             : sm90::RunForward<Budgeted128<kProducerRegs, kConsumerRegs, true, false>, BF16>(
                   p, stream);
}

template <>
cudaError_t RunForwardVariant<128, BF16>(int v, const FwdParams& p, cudaStream_t stream) {
  if (v < 1 || v > 3) return cudaErrorNotSupported;
  // segment ids, window tables: kernels of their own
  if (!sm90::Takes(p) || p.q_segments != nullptr || p.windows.heads > 0) {
    return RunForwardTiles<FwdConfig<128>::Traits, BF16>(p, stream);
  }
  if (v == 1) return RunHopperForward128<40, 232>(p, stream);
  if (v == 2) return RunHopperForward128<32, 232>(p, stream);
  return RunHopperForward128<56, 224>(p, stream);
}

}  // namespace dmattn::cuda
