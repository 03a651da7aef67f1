// CUDA attention kernels: the entry points the FFI handlers call. Host code only here.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace dmattn::cuda {

// The forward kernel: the dispatcher's choice (kAuto: the decode kernel for few query rows, on a
// Hopper GPU the warp-specialised kernel where it takes the call), or the FlashAttention-2-class
// kernel for every call of the process (side-by-side measurements and tests).
enum class ForwardKernel : int { kAuto = 0, kFlash2 = 1 };
void SetForwardKernel(ForwardKernel kernel);
// The forward kernel that Forward runs for this shape on the current device: "decode" (few
// query rows: decode_kernel.cuh), "hopper" (the warp-specialised kernel), "flash2" or
// "flash2_split" (FlashAttention-2 class, keys split).
const char* ForwardKernelName(const AttentionShape& shape);

// The backward kernel: the dispatcher's choice (kAuto: on a Hopper GPU the warp-specialised
// backward where it takes the call, sm90/bwd_launch.cuh) or the FlashAttention-2-class backward
// for every call of the process (kFlash2: side-by-side measurements and tests).
enum class BackwardKernel : int { kAuto = 0, kFlash2 = 1 };
void SetBackwardKernel(BackwardKernel kernel);

// Head dims with compiled kernels for this build (see CMake option JAX_DMATTN_HEAD_DIMS).
bool SupportsHeadDim(int64_t head_dim);
// False for a window table (AttentionShape::head_windows) of more kv heads than the kernels'
// parameters hold (kMaxWindowHeads).
bool SupportsHeadWindows(const AttentionShape& shape);

// The mask block map of a contiguous bool mask [entries, rows, cols]: one byte per kMaskMapCell
// x kMaskMapCell cell, [entries, ceil(rows / cell), ceil(cols / cell)], saying whether the cell
// has a true element and whether all are true. The attention kernels read it (args.mask_map) to
// skip hidden tiles; a forward and its backward share one.
// The same pass packs the mask to bits (args.mask_bits): [entries, rows, MaskBitsRowBytes(cols)]
// bytes, key j of a row in bit j % 8 of its byte j / 8, the padding zero, so that a kernel reads
// a tile's mask in an eighth of the bytes.
// `rule`'s diagonal / window rule (only diagonal_offset, window_left and window_right are read;
// rows are query and cols key positions) hides some cells from every query: those are not read
// but flagged kTileAll alone, which no tile test counts as visible nor as partly hidden, and
// their bits are zero. A mask broadcast over queries or keys takes an unbounded rule
// (AttentionShape's defaults).
cudaError_t BuildMaskBlockMap(const bool* mask, int64_t entries, int64_t rows, int64_t cols,
                              const AttentionShape& rule, uint8_t* cells, uint8_t* bits,
                              cudaStream_t stream);

// Launches the forward on `stream`; never synchronises. Returns the first CUDA error seen.
// args.mask_map, args.mask_bits: the mask's block map and bits (with a mask);
// args.workspace[0]: ForwardWorkspaceBytes(shape) bytes for the order of the query blocks and
// the split-KV partial results.
cudaError_t Forward(const AttentionShape& shape, const ForwardArgs& args, cudaStream_t stream);

// Launches the backward on `stream`; args.mask_map and mask_bits as in Forward, args.workspace[0] is an fp32
// dq accumulator shaped like q, args.workspace[1] BackwardWorkspaceBytes(shape) bytes for the
// order of the key blocks, an fp32 dbias accumulator and the deterministic dQ turn flags.
cudaError_t Backward(const AttentionShape& shape, const BackwardArgs& args, cudaStream_t stream);

// Bytes the backward needs in args.workspace[1]: the key-block order, then (when some dbias
// element receives contributions from more than one CTA, see DbiasNeedsWorkspace in launch.cu)
// an fp32 dbias accumulator, then (deterministic calls) the dQ turn flags of the Hopper
// backward.
int64_t BackwardWorkspaceBytes(const AttentionShape& shape);

// Key splits the forward runs in parallel for this shape on the current device (1: none; more
// for grids too small to fill the GPU, e.g. decoding), and the bytes of the forward's workspace
// (the query-block order and the splits' partial results).
int64_t ForwardSplits(const AttentionShape& shape);
int64_t ForwardWorkspaceBytes(const AttentionShape& shape);

// Bytes at the front of the forward's workspace and of the backward's workspace[1] that a call
// with index masks (segment ids, key ranges, row ranges, block indices) or a gate threshold
// needs for their summaries (0 without): a workspace of this size alone runs the call unsplit
// and in plain block order.
int64_t IndexMaskBytes(const AttentionShape& shape);

}  // namespace dmattn::cuda
