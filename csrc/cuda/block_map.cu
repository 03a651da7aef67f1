// The mask block map (kernel_params.h: MaskBlockMap): one warp per 64 x 64 cell reads the cell's
// mask bytes (16-byte loads where the mask allows) and writes kTileAny | kTileAll. One pass at
// full memory bandwidth, so the attention kernels never scan empty mask tiles themselves.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention.h"
#include "cuda/block_map.cuh"
#include "cuda/launch.h"

namespace dmattn::cuda {
namespace {

using detail::kMapCell;
using detail::kTileAll;
using detail::kTileAny;

struct MapBuild {
  const uint8_t* mask;
  MaskBlockMap map;
  int64_t cells;       // entries x rows x cols
  int64_t row_stride;  // of the mask (0: broadcast over queries)
  int64_t col_stride;  // (0: broadcast over keys)
  int valid_rows;      // Lq, or 1 when broadcast
  int valid_cols;      // Lk, or 1 when broadcast
  bool vec;            // 16-byte loads: contiguous columns, 16-byte aligned rows
};

constexpr int kMapWarps = 8;

__global__ void __launch_bounds__(kMapWarps * 32) mask_block_map_kernel(
    const __grid_constant__ MapBuild m) {
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kMapWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (cell >= m.cells) return;  // whole warps only
  const int64_t per_entry = static_cast<int64_t>(m.map.rows) * m.map.cols;
  const int64_t entry = cell / per_entry;
  const int rc = static_cast<int>(cell % per_entry);
  const int r0 = rc / m.map.cols * kMapCell, c0 = rc % m.map.cols * kMapCell;
  const int nr = min(kMapCell, m.valid_rows - r0), nc = min(kMapCell, m.valid_cols - c0);
  const uint8_t* base =
      m.mask + entry * m.map.entry_elems + r0 * m.row_stride + c0 * m.col_stride;

  bool any = false, all = true;
  if (m.vec && nc == kMapCell) {
    constexpr int kChunksPerRow = kMapCell / 16;
    constexpr int kPerLane = kMapCell * kChunksPerRow / 32;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {  // independent loads, all in flight at once
      const int id = lane + 32 * k;
      if (id < nr * kChunksPerRow) {
        const uint4 v = *reinterpret_cast<const uint4*>(base + (id / kChunksPerRow) * m.row_stride +
                                                        (id % kChunksPerRow) * 16);
        any = any || (v.x | v.y | v.z | v.w) != 0;
        all = all && detail::no_zero_byte(v.x) && detail::no_zero_byte(v.y) &&
              detail::no_zero_byte(v.z) && detail::no_zero_byte(v.w);
      }
    }
  } else {
    for (int id = lane; id < nr * nc; id += 32) {
      const bool x = base[(id / nc) * m.row_stride + (id % nc) * m.col_stride] != 0;
      any = any || x;
      all = all && x;
    }
  }
  any = __any_sync(0xffffffffu, any);
  all = __all_sync(0xffffffffu, all);
  if (lane == 0) m.map.cells[cell] = any ? (kTileAny | (all ? kTileAll : 0)) : 0;
}

int Cells(int64_t n) { return static_cast<int>((n + kMapCell - 1) / kMapCell); }

MaskBlockMap MaskBlockMapLayout(const AttentionShape& s, void* cells) {
  MaskBlockMap map;
  if (!s.mask.present) return map;
  const bool rows_full = s.mask.row_stride != 0, cols_full = s.mask.col_stride != 0;
  map.cells = static_cast<uint8_t*>(cells);
  map.rows = rows_full ? Cells(s.seqlen_q) : 1;
  map.cols = cols_full ? Cells(s.seqlen_k) : 1;
  const int64_t entry_elems = (rows_full ? s.seqlen_q : 1) * (cols_full ? s.seqlen_k : 1);
  map.entry_elems = entry_elems > 0 ? entry_elems : 1;  // an empty mask has no cells
  return map;
}

}  // namespace

int64_t MaskBlockMapBytes(const AttentionShape& s) {
  const MaskBlockMap map = MaskBlockMapLayout(s, nullptr);
  if (!s.mask.present) return 0;
  return s.mask.num_elements / map.entry_elems * map.rows * map.cols;
}

cudaError_t BuildMaskBlockMap(const AttentionShape& s, const uint8_t* mask, bool vec,
                              void* cells, cudaStream_t stream, MaskBlockMap* map) {
  if (mask == nullptr) return cudaSuccess;
  *map = MaskBlockMapLayout(s, cells);
  MapBuild m;
  m.mask = mask;
  m.map = *map;
  m.cells = MaskBlockMapBytes(s);
  if (m.cells == 0) return cudaSuccess;
  if (cells == nullptr) return cudaErrorInvalidValue;
  m.row_stride = s.mask.row_stride;
  m.col_stride = s.mask.col_stride;
  m.valid_rows = m.row_stride != 0 ? static_cast<int>(s.seqlen_q) : 1;
  m.valid_cols = m.col_stride != 0 ? static_cast<int>(s.seqlen_k) : 1;
  m.vec = vec;
  const int64_t blocks = (m.cells + kMapWarps - 1) / kMapWarps;
  mask_block_map_kernel<<<static_cast<unsigned>(blocks), kMapWarps * 32, 0, stream>>>(m);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
