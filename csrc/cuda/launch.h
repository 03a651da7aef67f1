// Declarations shared by launch.cu (dispatch) and the instantiation files (one launcher per
// head dim and dtype). Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention.h"
#include "cuda/kernel_params.h"

namespace dmattn::cuda {

// Forward tile (query rows x key columns) per head dim: FwdConfig's tiles and the split rule
// below read this one table.
struct FwdTile {
  int bm, bn;
};
constexpr FwdTile ForwardTile(int64_t head_dim) {
  switch (head_dim) {
    case 32: return {128, 128};
    case 64:
    case 96: return {128, 64};
    case 128: return {64, 128};  // 16 rows per warp: no register spills, more CTAs
    default: return {64, 64};
  }
}

// The forward tile of calls with block indices of blocks finer than ForwardTile(D)
// (FinerBlocks): its tiles then each hold one 64 x 64 block, skipped or whole, instead of several
// partly listed ones (the backward takes its 64-key tile likewise). Block indices of 64 x 64
// blocks, top 16 of 256, L16k D128 H16 on an H100: forward 0.338x -> 0.151x of the dense
// forward, forward + backward 0.223x -> 0.134x.
constexpr FwdTile kBlockForwardTile{64, 64};
inline bool FinerBlocks(const AttentionShape& s, int bm, int bn) {
  return s.block_indices.present && (s.block_q < bm || s.block_k < bn);
}
// Block indices alone (no other O(L) form) whose blocks hold whole bm x bn tiles: the Hopper
// kernels' walks skip the tiles no listed block meets, and every other tile is whole (no score
// tested): the forward's 64-row warpgroups against 64- or 128-key blocks, the backward's 64 x 128
// tiles.
inline bool BlockIndicesHoldTiles(const AttentionShape& s, int bm, int bn) {
  return s.block_indices.present && !s.key_ranges.present && !s.row_ranges.present &&
         s.block_q % bm == 0 && s.block_k % bn == 0;
}
inline FwdTile ForwardTileOf(const AttentionShape& s) {
  const FwdTile tile = ForwardTile(s.head_dim);
  return FinerBlocks(s, tile.bm, tile.bn) ? kBlockForwardTile : tile;
}

// Multiprocessors of the current device (132 when it cannot be queried).
int MultiProcessors();

// Forward CTAs that run at once: two per SM (the forward tiles' shared memory and registers).
inline int64_t ForwardSlots() { return 2 * static_cast<int64_t>(MultiProcessors()); }

// The narrowest key block of any backward tile: it sizes the key-block order's workspace.
constexpr int kSmallestBackwardKeyBlock = 64;

// The dQ turn flags of a deterministic call (BwdParams::dq_turns): an int32 per batch entry,
// query head and kDqTurnRows query rows, a 1/(kDqTurnRows * head_dim) of the dQ accumulator.
inline int64_t DqTurnBytes(const AttentionShape& s) {
  if (!s.deterministic) return 0;
  const int64_t row_blocks = (s.seqlen_q + kDqTurnRows - 1) / kDqTurnRows;
  return s.batch_count() * s.num_heads * row_blocks * static_cast<int64_t>(sizeof(int32_t));
}

// True when the current device is a Hopper GPU and this build holds sm_90a kernels (wgmma):
// the backward then runs its warpgroup-shaped tiles.
bool HopperKernels();

// The forward generation that SetForwardKernel (attention.h) chose for this process.
ForwardKernel ForwardKernelSetting();
// The backward generation that SetBackwardKernel chose for this process.
BackwardKernel BackwardKernelSetting();

// The decode forward (decode_kernel.cuh) takes calls of at most kDecodeMaxQueryRows query rows
// at these head dims: the H / Hk query heads of a kv head share its tiles, so K and V are read
// once per kv head.
constexpr int64_t kDecodeMaxQueryRows = 16;
// (At D = 256 its O alone takes 128 registers a thread and the kernel spilled: the
// FlashAttention-2-class split forward keeps those calls.)
constexpr bool HasDecodeForward(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
// Packed rows ((H / Hk) * Lq of them) per decode CTA: 16, 32 or 64 (then several row blocks).
constexpr int DecodeRowTile(int64_t rows) { return rows <= 16 ? 16 : (rows <= 32 ? 32 : 64); }
// Decode CTAs that run at once on one SM (their shared memory: the K/V ring and the Q tile).
constexpr int DecodeCtasPerSm(int64_t head_dim) { return head_dim <= 64 ? 3 : 2; }
// True when the dispatcher runs the decode forward for a call of this shape.
bool DecodeTakes(const AttentionShape& shape);

// Head dims with a warp-specialised Hopper forward (sm90/fwd_launch.cuh has their tiles).
constexpr bool HasHopperForward(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}
// True when, on a Hopper GPU of an sm_90a build, the dispatcher runs the Hopper forward for a
// call of this shape that splits its keys `num_splits` ways (its pointers allowing TMA).
bool HopperForwardTakes(const AttentionShape& shape, int64_t num_splits);
// True when a CUDA forward applies the call's softmax threshold (AttentionShape::
// softmax_threshold): head dims 64 and 128, without a gate threshold; the Hopper kernels where
// they take the call (no gate, segment ids, O(L) mask forms or window table), else the
// FlashAttention-2-class ones (any GPU, any mask and bias layout, the index masks, window tables,
// the gate).
bool ThresholdTakes(const AttentionShape& shape);

// Lets `kernel` launch with `bytes` of dynamic shared memory (past 48 KB it must ask).
template <typename Kernel>
inline cudaError_t PrepareSmem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Everything the backward launcher needs beyond the kernel parameter block.
struct BwdLaunch {
  BwdParams p;
  const void* out = nullptr;
  bool out_f32 = false;  // out is float32, else T
  const float* dlse = nullptr;
  float* softmax_d = nullptr;
  void* dq = nullptr;
  int64_t dbias_elems = 0;
};

// How the kernels read the block map `cells` and the bits (BuildMaskBlockMap) of the call's mask.
MaskBlockMap MaskBlockMapLayout(const AttentionShape& shape, const uint8_t* cells,
                                const uint8_t* bits);

// The spans pass of the segment ids (segments.cu): writes layout's spans (at `spans`) from the
// id rows q_ids [rows, lq] and kv_ids [rows, lk].
cudaError_t BuildSegmentSpans(const int32_t* q_ids, const int32_t* kv_ids, int64_t lq, int64_t lk,
                              const SegmentSpanLayout& layout, int2* spans, cudaStream_t stream);

// The summaries pass of the O(L) mask forms (mask_forms.cu): MaskFormsBytes(shape) bytes of
// summaries at `workspace`, and `forms` pointing at them and at the forms (a call without forms:
// none, nothing launched).
int64_t MaskFormsBytes(const AttentionShape& shape);
cudaError_t BuildMaskForms(const AttentionShape& shape, const int32_t* key_start,
                           const int32_t* key_end, const int32_t* row_start, const int32_t* row_end,
                           const int32_t* block_indices, uint8_t* workspace, MaskForms* forms,
                           cudaStream_t stream);

// The bounds pass of the gate threshold (gate.cu): GateBoundsBytes(shape) bytes of bounds at
// `workspace` and `bounds` pointing at them (a call without a gate threshold: none, nothing
// launched).
int64_t GateBoundsBytes(const AttentionShape& shape);
cudaError_t BuildGateBounds(const AttentionShape& shape, const float* alpha, const float* delta,
                            uint8_t* workspace, GateBounds* bounds, cudaStream_t stream);

template <int D, typename T>
cudaError_t RunForward(const FwdParams& params, cudaStream_t stream);

template <int D, typename T>
cudaError_t RunBackward(const BwdLaunch& launch, cudaStream_t stream);

}  // namespace dmattn::cuda
