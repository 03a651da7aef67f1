// Parameter block of the warp-specialised Hopper forward: the forward's FwdParams, the order of
// the tiles (fwd_scheduler.cuh) and the TMA descriptors of q, k, v and out (tensor_maps.h).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/kernel_params.h"

namespace dmattn::cuda::sm90 {

// Tiles are (batch, head, query block); see fwd_scheduler.cuh.
struct TileOrder {
  int64_t tiles = 0;
  int64_t heads = 0;         // (batch, head) pairs
  int64_t group_heads = 1;   // pairs whose K / V fit the L2 cache together
  int m_blocks = 0;
  int* counter = nullptr;  // tiles taken after each CTA's first (zeroed), or null: stride
};

struct FwdParamsSm90 {
  FwdParams p;
  TileOrder order;
  int64_t kv_entry_elems;  // elements of k (or v) per distinct batch entry: Lk * Hk * D
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap o_map;  // unused when out is float32
};

}  // namespace dmattn::cuda::sm90
