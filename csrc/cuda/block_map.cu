// The mask block map (kernel_params.h: MaskBlockMap): one warp per 64 x 64 cell reads the cell's
// mask bytes (16-byte loads where the mask allows) and writes kTileAny | kTileAll. One pass at
// full memory bandwidth, so the attention kernels never scan empty mask tiles themselves. It is
// its own FFI call, so that under one jit the forward and the backward share one map. Cells that
// causality or the window hide from every query are never looked at by the kernels, so the pass
// skips their bytes (half of a causal mask).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention.h"
#include "cuda/block_map.cuh"
#include "cuda/launch.h"

namespace dmattn::cuda {
namespace {

using detail::kTileAll;
using detail::kTileAny;

// A contiguous mask [entries, rows, cols] and its map [entries, ceil(rows / cell), ceil(cols /
// cell)].
struct MapBuild {
  const uint8_t* mask;
  uint8_t* cells;
  int64_t count;  // cells of the map
  int rows, cols;  // of one mask entry
  int cell_rows, cell_cols;  // of one map entry
  bool vec;  // 16-byte loads: every row starts on 16 bytes
  detail::Band band;  // rows are queries, cols keys
};


constexpr int kMapWarps = 8;

__global__ void __launch_bounds__(kMapWarps * 32) mask_block_map_kernel(
    const __grid_constant__ MapBuild m) {
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kMapWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (cell >= m.count) return;  // whole warps only
  const int64_t per_entry = static_cast<int64_t>(m.cell_rows) * m.cell_cols;
  const int64_t entry = cell / per_entry;
  const int rc = static_cast<int>(cell % per_entry);
  const int r0 = rc / m.cell_cols * kMaskMapCell, c0 = rc % m.cell_cols * kMaskMapCell;
  const int nr = min(kMaskMapCell, m.rows - r0), nc = min(kMaskMapCell, m.cols - c0);
  // the attention kernels' own key-block range of these rows (kernel_utils.cuh)
  const detail::BlockRange seen = detail::visible_key_blocks<kMaskMapCell, kMaskMapCell>(
      detail::SeqLens{m.rows, m.cols}, m.band, r0);
  const int cc = c0 / kMaskMapCell;
  if (cc < seen.lo || cc >= seen.hi) {
    if (lane == 0) m.cells[cell] = kTileAll;  // neutral in every tile test (block_map.cuh)
    return;
  }
  const uint8_t* base = m.mask + (entry * m.rows + r0) * m.cols + c0;

  bool any = false, all = true;
  if (m.vec && nc == kMaskMapCell) {
    constexpr int kChunksPerRow = kMaskMapCell / 16;
    constexpr int kPerLane = kMaskMapCell * kChunksPerRow / 32;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {  // independent loads, all in flight at once
      const int id = lane + 32 * k;
      if (id < nr * kChunksPerRow) {
        const uint4 v = *reinterpret_cast<const uint4*>(base + (id / kChunksPerRow) * m.cols +
                                                        (id % kChunksPerRow) * 16);
        any = any || (v.x | v.y | v.z | v.w) != 0;
        all = all && detail::no_zero_byte(v.x) && detail::no_zero_byte(v.y) &&
              detail::no_zero_byte(v.z) && detail::no_zero_byte(v.w);
      }
    }
  } else {
    for (int id = lane; id < nr * nc; id += 32) {
      const bool x = base[(id / nc) * m.cols + id % nc] != 0;
      any = any || x;
      all = all && x;
    }
  }
  any = __any_sync(0xffffffffu, any);
  all = __all_sync(0xffffffffu, all);
  if (lane == 0) m.cells[cell] = any ? (kTileAny | (all ? kTileAll : 0)) : 0;
}

int Cells(int64_t n) { return static_cast<int>((n + kMaskMapCell - 1) / kMaskMapCell); }

}  // namespace

MaskBlockMap MaskBlockMapLayout(const AttentionShape& s, const uint8_t* cells) {
  MaskBlockMap map;
  if (!s.mask.present) return map;
  const bool rows_full = s.mask.row_stride != 0, cols_full = s.mask.col_stride != 0;
  map.cells = cells;
  map.rows = rows_full ? Cells(s.seqlen_q) : 1;
  map.cols = cols_full ? Cells(s.seqlen_k) : 1;
  const int64_t entry_elems = (rows_full ? s.seqlen_q : 1) * (cols_full ? s.seqlen_k : 1);
  map.entry_elems = entry_elems > 0 ? entry_elems : 1;  // an empty mask has no cells
  return map;
}

cudaError_t BuildMaskBlockMap(const bool* mask, int64_t entries, int64_t rows, int64_t cols,
                              const AttentionShape& rule, uint8_t* cells, cudaStream_t stream) {
  MapBuild m;
  m.mask = reinterpret_cast<const uint8_t*>(mask);
  m.cells = cells;
  m.rows = static_cast<int>(rows);
  m.cols = static_cast<int>(cols);
  m.cell_rows = Cells(rows);
  m.cell_cols = Cells(cols);
  m.count = entries * m.cell_rows * m.cell_cols;
  if (m.count == 0) return cudaSuccess;
  if (mask == nullptr || cells == nullptr) return cudaErrorInvalidValue;
  m.vec = cols % 16 == 0 && reinterpret_cast<uintptr_t>(mask) % 16 == 0;
  m.band = detail::make_band(rule);
  const int64_t blocks = (m.count + kMapWarps - 1) / kMapWarps;
  mask_block_map_kernel<<<static_cast<unsigned>(blocks), kMapWarps * 32, 0, stream>>>(m);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
