// Parameter block of the warp-specialised Hopper forward: the forward's FwdParams, the order of
// the tiles (fwd_scheduler.cuh) and the TMA descriptors of q, k, v and out (tensor_maps.h).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda::sm90 {

// Tiles are (batch, head, query block); see fwd_scheduler.cuh.
struct TileOrder {
  int64_t tiles = 0;
  int64_t heads = 0;         // (batch, head) pairs
  int64_t group_heads = 1;   // pairs whose K / V fit the L2 cache together
  int m_blocks = 0;
  int* counter = nullptr;  // tiles taken after each CTA's first (zeroed), or null: stride
};

// The (batch entry, head entry) of a mask or bias operand that one (batch, head) reads.
struct OperandEntry {
  int batch = 0;
  int head = 0;
};

// Where the tile of a mask or bias operand lies in its tensor map (tensor_maps.h: [batch
// entries, head entries, rows, cols]).
struct OperandTiles {
  int64_t batch_entry_elems = 1;  // elements per batch entry
  int head_entries = 1;           // 1 when broadcast over heads
  bool per_head = false;          // one entry per head (group), else broadcast over heads
  bool one_row = false;           // broadcast over queries: one row per tile
  __device__ __forceinline__ int batch_coord(const BroadcastOperand& op, const BatchShape& batch,
                                             int64_t b) const {
    return static_cast<int>(op.batch.offset(batch, b) / batch_entry_elems);
  }
  __device__ __forceinline__ int head_coord(const BroadcastOperand& op, int h) const {
    return per_head ? static_cast<int>(h / op.heads_per_entry) : 0;
  }
  __device__ __forceinline__ OperandEntry entry(const BroadcastOperand& op,
                                                const BatchShape& batch, int64_t b, int h) const {
    return {batch_coord(op, batch, b), head_coord(op, h)};
  }
  // The entry's index in the operand's own layout, as the mask's block map counts them.
  __device__ __forceinline__ int64_t index(OperandEntry e) const {
    return static_cast<int64_t>(e.batch) * head_entries + e.head;
  }
};

struct FwdParamsSm90 {
  FwdParams p;
  TileOrder order;
  int64_t kv_entry_elems;  // elements of k (or v) per distinct batch entry: Lk * Hk * D
  // make_band(p.s), worked out on the host: made in the kernel it is some 30 instructions of
  // 64-bit arithmetic, which the consumers paid for every key block (5 % of their instructions)
  detail::Band band;
  OperandTiles bias_tiles, mask_tiles;
  CUtensorMap q_tma;
  CUtensorMap k_tma;
  CUtensorMap v_tma;
  CUtensorMap o_tma;     // unused when out is float32
  CUtensorMap bias_tma;  // with a bias
  CUtensorMap mask_tma;  // with a mask: its bits (MaskBlockMap::bits)
};

}  // namespace dmattn::cuda::sm90
