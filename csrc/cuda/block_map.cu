// The mask block map (kernel_params.h: MaskBlockMap): one warp per 64 x 64 cell reads the cell's
// mask bytes (16-byte loads where the mask allows), writes kTileAny | kTileAll and packs the
// cell's rows to bits (8 bytes a row). One pass at full memory bandwidth, so the attention
// kernels never scan empty mask tiles themselves, and the Hopper forward reads an eighth of the
// mask's bytes. It is its own FFI call, so that under one jit the forward and the backward share
// one map. Cells that causality or the window hide from every query are never looked at by the
// kernels, so the pass skips their bytes (half of a causal mask) and writes zero bits.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention.h"
#include "cuda/block_map.cuh"
#include "cuda/launch.h"

namespace dmattn::cuda {
namespace {

using detail::kTileAll;
using detail::kTileAny;

// A contiguous mask [entries, rows, cols], its map [entries, ceil(rows / cell), ceil(cols /
// cell)] and its bits [entries, rows, bits_pitch].
struct MapBuild {
  const uint8_t* mask;
  uint8_t* cells;
  uint8_t* bits;
  int64_t count;  // cells of the map
  int rows, cols;  // of one mask entry
  int cell_rows, cell_cols;  // of one map entry
  int bits_pitch;  // MaskBitsRowBytes(cols)
  bool vec;  // 16-byte loads: every row starts on 16 bytes
  detail::Band band;  // rows are queries, cols keys
};

constexpr int kMapWarps = 8;
constexpr int kCellBitsBytes = kMaskMapCell / 8;  // bytes of bits per row of a cell
static_assert(kMaskMapCell == 64, "a cell row's bits are one 8-byte word");

// Bit i: byte i of x is not zero (i < 4).
__device__ __forceinline__ uint32_t nonzero_bytes(uint32_t x) {
  return ((__vcmpne4(x, 0u) & 0x01010101u) * 0x01020408u) >> 24;
}

// Zero bits for columns [first_byte * 8, row_bytes * 8) of the cell's rows, 8 bytes at a time.
__device__ __forceinline__ void zero_bits(uint8_t* bits, int pitch, int nr, int first_byte,
                                          int row_bytes, int lane) {
  const int words = (row_bytes - first_byte) / 8;
  for (int i = lane; i < nr * words; i += 32) {
    *reinterpret_cast<uint2*>(bits + (i / words) * pitch + first_byte + 8 * (i % words)) =
        make_uint2(0u, 0u);
  }
}

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
  const int cc = c0 / kMaskMapCell;
  uint8_t* bits = m.bits + (entry * m.rows + r0) * m.bits_pitch + c0 / 8;
  // The cell's bytes of each bits row: its own, and the row's padding after the last cell.
  const int row_bytes = cc == m.cell_cols - 1 ? m.bits_pitch - c0 / 8 : kCellBitsBytes;
  // the attention kernels' own key-block range of these rows (kernel_utils.cuh)
  const detail::BlockRange seen = detail::visible_key_blocks<kMaskMapCell, kMaskMapCell>(
      detail::SeqLens{m.rows, m.cols}, m.band, r0);
  if (cc < seen.lo || cc >= seen.hi) {
    zero_bits(bits, m.bits_pitch, nr, 0, row_bytes, lane);
    if (lane == 0) m.cells[cell] = kTileAll;  // neutral in every tile test (block_map.cuh)
    return;
  }
  zero_bits(bits, m.bits_pitch, nr, kCellBitsBytes, row_bytes, lane);
  const uint8_t* base = m.mask + (entry * m.rows + r0) * m.cols + c0;

  bool any = false, all = true;
  if (m.vec && nc == kMaskMapCell) {
    constexpr int kChunksPerRow = kMaskMapCell / 16;
    constexpr int kPerLane = kMaskMapCell * kChunksPerRow / 32;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {  // independent loads, all in flight at once
      const int id = lane + 32 * k;
      const int row = id / kChunksPerRow, chunk = id % kChunksPerRow;
      if (row < nr) {
        const uint4 v = *reinterpret_cast<const uint4*>(base + row * m.cols + chunk * 16);
        const uint32_t packed = nonzero_bytes(v.x) | nonzero_bytes(v.y) << 4 |
                                nonzero_bytes(v.z) << 8 | nonzero_bytes(v.w) << 12;
        *reinterpret_cast<uint16_t*>(bits + row * m.bits_pitch + chunk * 2) =
            static_cast<uint16_t>(packed);
        any = any || packed != 0;
        all = all && packed == 0xffffu;
      }
    }
    any = __any_sync(0xffffffffu, any);
    all = __all_sync(0xffffffffu, all);
  } else {  // a row's 32 columns at a time, packed by a ballot
    for (int row = 0; row < nr; ++row) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = 32 * half + lane;
        const unsigned word =
            __ballot_sync(0xffffffffu, col < nc && base[row * m.cols + col] != 0);
        const unsigned cols_in = 32 * half >= nc ? 0u
                                 : nc - 32 * half >= 32 ? 0xffffffffu
                                                        : (1u << (nc - 32 * half)) - 1u;
        if (lane == 0) *reinterpret_cast<uint32_t*>(bits + row * m.bits_pitch + 4 * half) = word;
        any = any || word != 0;
        all = all && word == cols_in;
      }
    }
  }
  if (lane == 0) m.cells[cell] = any ? (kTileAny | (all ? kTileAll : 0)) : 0;
}

int Cells(int64_t n) { return static_cast<int>((n + kMaskMapCell - 1) / kMaskMapCell); }

}  // namespace

MaskBlockMap MaskBlockMapLayout(const AttentionShape& s, const uint8_t* cells,
                                const uint8_t* bits) {
  MaskBlockMap map;
  if (!s.mask.present) return map;
  const bool rows_full = s.mask.row_stride != 0, cols_full = s.mask.col_stride != 0;
  map.cells = cells;
  map.bits = bits;
  map.rows = rows_full ? Cells(s.seqlen_q) : 1;
  map.cols = cols_full ? Cells(s.seqlen_k) : 1;
  const int64_t entry_elems = (rows_full ? s.seqlen_q : 1) * (cols_full ? s.seqlen_k : 1);
  map.entry_elems = entry_elems > 0 ? entry_elems : 1;  // an empty mask has no cells
  return map;
}

cudaError_t BuildMaskBlockMap(const bool* mask, int64_t entries, int64_t rows, int64_t cols,
                              const AttentionShape& rule, uint8_t* cells, uint8_t* bits,
                              cudaStream_t stream) {
  MapBuild m;
  m.mask = reinterpret_cast<const uint8_t*>(mask);
  m.cells = cells;
  m.bits = bits;
  m.bits_pitch = static_cast<int>(MaskBitsRowBytes(cols));
  m.rows = static_cast<int>(rows);
  m.cols = static_cast<int>(cols);
  m.cell_rows = Cells(rows);
  m.cell_cols = Cells(cols);
  m.count = entries * m.cell_rows * m.cell_cols;
  if (m.count == 0) return cudaSuccess;
  if (mask == nullptr || cells == nullptr || bits == nullptr) return cudaErrorInvalidValue;
  m.vec = cols % 16 == 0 && reinterpret_cast<uintptr_t>(mask) % 16 == 0;
  m.band = detail::make_band(rule);
  const int64_t blocks = (m.count + kMapWarps - 1) / kMapWarps;
  mask_block_map_kernel<<<static_cast<unsigned>(blocks), kMapWarps * 32, 0, stream>>>(m);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
