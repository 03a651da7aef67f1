// CUDA attention kernels: the entry points the FFI handlers call. Host code only here.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace dmattn::cuda {

// Head dims with compiled kernels for this build (see CMake option JAX_DMATTN_HEAD_DIMS).
bool SupportsHeadDim(int64_t head_dim);

// Launches the forward on `stream`; never synchronises. Returns the first CUDA error seen.
// args.workspace[0]: the mask block map, MaskBlockMapBytes(shape) bytes (with a mask);
// args.workspace[1]: split-KV partial results, ForwardSplitWorkspaceBytes(shape) bytes.
cudaError_t Forward(const AttentionShape& shape, const ForwardArgs& args, cudaStream_t stream);

// Launches the backward on `stream`; args.workspace[0] is an fp32 dq accumulator shaped like q,
// args.workspace[1] the mask block map (MaskBlockMapBytes(shape) bytes, with a mask),
// args.workspace[2] an fp32 dbias accumulator of BackwardDbiasWorkspaceElements(shape) elements.
cudaError_t Backward(const AttentionShape& shape, const BackwardArgs& args, cudaStream_t stream);

// fp32 elements the backward needs in args.workspace[1] (0 when none): some dbias element then
// receives contributions from more than one CTA (see DbiasNeedsWorkspace in launch.cu).
int64_t BackwardDbiasWorkspaceElements(const AttentionShape& shape);

// Key splits the forward runs in parallel for this shape on the current device (1: none; more
// for grids too small to fill the GPU, e.g. decoding), and the bytes of their partial results.
int64_t ForwardSplits(const AttentionShape& shape);
int64_t ForwardSplitWorkspaceBytes(const AttentionShape& shape);

// Bytes of the mask block map (one byte per 64 x 64 cell of every mask entry); 0 without a mask.
int64_t MaskBlockMapBytes(const AttentionShape& shape);

}  // namespace dmattn::cuda
