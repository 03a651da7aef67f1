// The mask block map (kernel_params.h: MaskBlockMap): a CTA reads eight adjacent 64 x 64 cells
// of one 64-row band, writes each cell's kTileAny | kTileAll and packs the cells' rows to bits
// (8 bytes a cell row) in shared memory, from where the band's 64 bytes a row leave in whole
// 32-byte sectors. Where the mask allows 16-byte loads, each warp load is 512 contiguous bytes
// of one row (a lane a 16-byte chunk), eight rows a warp in flight at once; else a warp a cell,
// a row's 32 columns at a time. One pass at memory speed, so the attention kernels never scan
// empty mask tiles themselves, and the Hopper forward reads an eighth of the mask's bytes. It is
// its own FFI call, so that under one jit the forward and the backward share one map. Cells that
// causality or the window hide from every query are never looked at by the kernels, so the
// pass skips their bytes (half of a causal mask); their bits are zero where a kernel tile may
// still cover them, else not written.
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
  int rows, cols;  // of one mask entry
  int cell_rows, cell_cols;  // of one map entry
  int groups;  // CTAs of a band: ceil(cell_cols / kMapWarps)
  int bits_pitch;  // MaskBitsRowBytes(cols)
  bool vec;  // 16-byte loads: every row starts on 16 bytes
  detail::Band band;  // rows are queries, cols keys
};

constexpr int kMapWarps = 8;  // cells of a CTA
constexpr int kCellBitsBytes = kMaskMapCell / 8;  // bytes of bits per row of a cell
constexpr int kBandBytes = kMapWarps * kCellBitsBytes;  // a CTA's bytes of a bits row
static_assert(kMaskMapCell == 64, "a cell row's bits are one 8-byte word");
static_assert(kBandBytes % 16 == 0, "bits rows leave in 16-byte stores");
// The tallest kernel tile (rows) that reads bits: the Hopper forward's 192-row tile at D = 64.
constexpr int kTallestTile = 192;

// The key range [lo, hi) that any of rows [first, last] sees (empty: lo >= hi).
__device__ __forceinline__ void visible_keys(const MapBuild& m, int first, int last, int64_t* lo,
                                             int64_t* hi) {
  *lo = static_cast<int64_t>(first) + m.band.dmin;
  *hi = static_cast<int64_t>(last) + m.band.dmax + 1;
  *lo = *lo < 0 ? 0 : *lo;
  *hi = *hi > m.cols ? m.cols : *hi;
}

// The flags of a cell whose rows have been read: any key shown, every key shown.
__device__ __forceinline__ int cell_flags(bool any, bool all) {
  return any ? (kTileAny | (all ? kTileAll : 0)) : 0;
}

// Bit i of the result: byte i of 16 mask bytes (XLA's bool is a byte holding exactly 0 or 1).
// Two words a product: with the second word's bytes moved to bit 4 of the first's, multiplying
// by 2^24 + 2^17 + 2^10 + 2^3 brings byte i's bits 0 and 4 to bits 24 + i and 28 + i; every
// other term lands below bit 24 on a bit of its own (no carry) or past bit 31. Three
// instructions per 8 bytes where testing each byte for zero took eight per 4.
__device__ __forceinline__ uint32_t bits_of_bytes(uint4 v) {
  const uint32_t lo = ((v.x | v.y << 4) * 0x01020408u) >> 24;
  const uint32_t hi = ((v.z | v.w << 4) * 0x01020408u) >> 24;
  return lo | hi << 8;
}

// The band's eight cells with 16-byte loads (every row starts on 16 bytes, cols % 16 == 0):
// warp w reads rows w, w + 8, .., lane l the chunk l % 4 of cell l / 4, whose 16 bits land at
// bytes 2 l, 2 l + 1 of the bits row. A lane's cell outside `seen` (or past the last column) is
// not read: zero bits. Returns the flags of cell threadIdx.x (threads < kMapWarps).
__device__ __forceinline__ int pack_band(const MapBuild& m, const uint8_t* band, int nr, int c0,
                                         detail::BlockRange seen, uint8_t (*tile)[kBandBytes],
                                         uint32_t (*votes)[kMapWarps], int w, int lane) {
  constexpr int kRowsPerWarp = kMaskMapCell / kMapWarps;
  const int cell = c0 / kMaskMapCell + lane / 4, col = c0 + 16 * lane;
  const bool reads = cell >= seen.lo && cell < seen.hi && col < m.cols;
  uint4 v[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {  // independent loads, all in flight at once
    const int row = w + kMapWarps * k;
    v[k] = reads && row < nr ? *reinterpret_cast<const uint4*>(band + row * m.cols + col)
                             : make_uint4(0u, 0u, 0u, 0u);
  }
  bool any = false, all = true;
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int row = w + kMapWarps * k;
    const uint32_t packed = bits_of_bytes(v[k]);
    *reinterpret_cast<uint16_t*>(&tile[row][2 * lane]) = static_cast<uint16_t>(packed);
    if (reads && row < nr) {
      any = any || packed != 0;
      all = all && packed == 0xffffu;
    }
  }
  // a cell's chunks are four lanes of each warp: one vote word a warp, one reduction a cell
  const uint32_t any_lanes = __ballot_sync(0xffffffffu, any);
  const uint32_t all_lanes = __ballot_sync(0xffffffffu, all);
  if (lane == 0) votes[0][w] = any_lanes, votes[1][w] = all_lanes;
  __syncthreads();
  if (threadIdx.x >= kMapWarps) return 0;
  uint32_t any_cell = 0u, all_cell = 0xfu;
#pragma unroll
  for (int i = 0; i < kMapWarps; ++i) {
    any_cell |= votes[0][i] >> (4 * threadIdx.x) & 0xfu;
    all_cell &= votes[1][i] >> (4 * threadIdx.x) & 0xfu;
  }
  return cell_flags(any_cell != 0, all_cell == 0xfu);
}

// One cell's flags and its rows' bits, a row's 32 columns at a time packed by a ballot (masks
// whose rows do not start on 16 bytes): the warp's nr x nc bytes of the mask from base.
__device__ __forceinline__ int pack_cell(const MapBuild& m, const uint8_t* base, int nr, int nc,
                                         uint8_t (*tile)[kBandBytes], int w, int lane) {
  bool any = false, all = true;
  for (int row = 0; row < kMaskMapCell; ++row) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = 32 * half + lane;
      const unsigned word =
          __ballot_sync(0xffffffffu, row < nr && col < nc && base[row * m.cols + col] != 0);
      const unsigned cols_in = 32 * half >= nc ? 0u
                               : nc - 32 * half >= 32 ? 0xffffffffu
                                                      : (1u << (nc - 32 * half)) - 1u;
      if (lane == 0) *reinterpret_cast<uint32_t*>(&tile[row][w * kCellBitsBytes + 4 * half]) = word;
      if (row < nr) {
        any = any || word != 0;
        all = all && word == cols_in;
      }
    }
  }
  return cell_flags(any, all);
}

// Six CTAs an SM (40 registers, no spill): of 5, 6 and 8 (44, 40, 32 registers) the fastest on
// both a broadcast [1, 1, L, L] mask and a causal [B, H, L, L] one (H200).
__global__ void __launch_bounds__(kMapWarps * 32, 6) mask_block_map_kernel(
    const __grid_constant__ MapBuild m) {
  __shared__ __align__(16) uint8_t tile[kMaskMapCell][kBandBytes];
  __shared__ uint32_t votes[2][kMapWarps];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // 32-bit index arithmetic: a 64-bit division costs every thread dozens of instructions
  const int band_index = static_cast<int>(blockIdx.x) / m.groups;  // over entries x cell rows
  const int group = static_cast<int>(blockIdx.x) % m.groups;
  const int64_t entry = band_index / m.cell_rows;
  const int r0 = band_index % m.cell_rows * kMaskMapCell;
  const int nr = min(kMaskMapCell, m.rows - r0);
  const int c0 = group * kMapWarps * kMaskMapCell;
  const uint8_t* band = m.mask + (entry * m.rows + r0) * m.cols;
  uint8_t* cells = m.cells + static_cast<int64_t>(band_index) * m.cell_cols;
  // the attention kernels' own key-block range of these rows (kernel_utils.cuh); a hidden cell
  // is kTileAll: neutral in every tile test (block_map.cuh)
  const detail::BlockRange seen = detail::visible_key_blocks<kMaskMapCell, kMaskMapCell>(
      detail::SeqLens{m.rows, m.cols}, m.band, r0);
  if (m.vec) {
    const int flags = pack_band(m, band, nr, c0, seen, tile, votes, w, lane);
    const int cc = c0 / kMaskMapCell + threadIdx.x;
    if (threadIdx.x < kMapWarps && cc < m.cell_cols) {
      cells[cc] = static_cast<uint8_t>(cc >= seen.lo && cc < seen.hi ? flags : kTileAll);
    }
  } else {
    const int cc = c0 / kMaskMapCell + w;
    if (cc < m.cell_cols && cc >= seen.lo && cc < seen.hi) {
      const int flags = pack_cell(m, band + cc * kMaskMapCell, nr,
                                  min(kMaskMapCell, m.cols - cc * kMaskMapCell), tile, w, lane);
      if (lane == 0) cells[cc] = static_cast<uint8_t>(flags);
    } else {  // hidden, or past the last cell (the row's padding): zero bits
      if (lane == 0 && cc < m.cell_cols) cells[cc] = kTileAll;
      for (int row = lane; row < kMaskMapCell; row += 32) {
        *reinterpret_cast<uint2*>(&tile[row][w * kCellBitsBytes]) = make_uint2(0u, 0u);
      }
    }
  }
  // A kernel tile that holds these rows reads their bits for every key block it sees; the bits
  // no such tile reads are left unwritten.
  int64_t lo, hi;
  visible_keys(m, max(0, r0 + kMaskMapCell - kTallestTile), min(m.rows, r0 + kTallestTile) - 1, &lo,
               &hi);
  if (lo >= hi || hi <= c0 || lo >= c0 + kMapWarps * kMaskMapCell) return;
  __syncthreads();
  const int first_byte = group * kBandBytes;
  constexpr int kChunks = kBandBytes / 16;  // 16-byte stores a bits row
  const int chunks = min(kBandBytes, m.bits_pitch - first_byte) / 16;  // in the pitch
  uint8_t* bits = m.bits + (entry * m.rows + r0) * m.bits_pitch + first_byte;
  for (int i = threadIdx.x; i < nr * kChunks; i += kMapWarps * 32) {
    const int row = i / kChunks, chunk = i % kChunks;
    if (chunk >= chunks) continue;
    *reinterpret_cast<uint4*>(bits + static_cast<int64_t>(row) * m.bits_pitch + 16 * chunk) =
        *reinterpret_cast<const uint4*>(&tile[row][16 * chunk]);
  }
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
  m.groups = (m.cell_cols + kMapWarps - 1) / kMapWarps;
  const int64_t ctas = entries * m.cell_rows * m.groups;
  if (ctas == 0) return cudaSuccess;
  if (mask == nullptr || cells == nullptr || bits == nullptr) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(bits) % 16 != 0) return cudaErrorMisalignedAddress;
  m.vec = cols % 16 == 0 && reinterpret_cast<uintptr_t>(mask) % 16 == 0;
  m.band = detail::make_band(rule);
  mask_block_map_kernel<<<static_cast<unsigned>(ctas), kMapWarps * 32, 0, stream>>>(m);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
