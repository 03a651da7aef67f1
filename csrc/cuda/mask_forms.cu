// The summaries pass of the O(L) mask forms (kernel_params.h: MaskForms): the hull of the ranges
// of every kRangeCell keys (rows) of key (row) ranges, one warp per cell; the listed blocks of
// block indices as bits, one thread per slot. The forms are O(L) and read once per call, so the
// attention kernels' walks read 16 bytes per 64 positions, or a word per 32 key blocks.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/launch.h"

namespace dmattn::cuda {
namespace {

constexpr int kCellWarps = 8;
constexpr int kSlotThreads = 256;
static_assert(kRangeCell == 64, "two positions a lane");

__host__ __device__ int64_t Cells(int64_t n) { return (n + kRangeCell - 1) / kRangeCell; }
int64_t RoundUp256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The shapes of a call's summaries (entries: a form's slices, one per (batch, head) entry).
struct FormsLayout {
  int64_t key_entries = 0, row_entries = 0, block_entries = 0;
  int64_t block_rows = 0, block_words = 0;

  explicit FormsLayout(const AttentionShape& s) {
    if (s.key_ranges.present) key_entries = s.key_ranges.num_elements / s.seqlen_k;
    if (s.row_ranges.present) row_entries = s.row_ranges.num_elements / s.seqlen_q;
    if (s.block_indices.present) {
      block_rows = (s.seqlen_q + s.block_q - 1) / s.block_q;
      block_words = ((s.seqlen_k + s.block_k - 1) / s.block_k + 31) / 32;
      block_entries = s.block_indices.num_elements / (block_rows * s.block_slots);
    }
  }
  int64_t key_bytes(const AttentionShape& s) const {
    return RoundUp256(key_entries * Cells(s.seqlen_k) * static_cast<int64_t>(sizeof(int4)));
  }
  int64_t row_bytes(const AttentionShape& s) const {
    return RoundUp256(row_entries * Cells(s.seqlen_q) * static_cast<int64_t>(sizeof(int4)));
  }
  int64_t bit_bytes() const {
    return RoundUp256(block_entries * block_rows * block_words *
                      static_cast<int64_t>(sizeof(uint32_t)));
  }
};

// The hull (RangeHull, mask_forms.cuh) of each cell of `entries` rows of n ranges.
__global__ void __launch_bounds__(kCellWarps * 32)
    range_cells_kernel(const int32_t* start, const int32_t* end, int64_t n, int64_t entries,
                       int4* cells) {
  const int64_t per_entry = Cells(n);
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kCellWarps + (threadIdx.x >> 5);
  if (cell >= entries * per_entry) return;  // whole warps only
  const int64_t first = cell / per_entry * n + cell % per_entry * kRangeCell;
  const int64_t last = cell / per_entry * n + n;  // the entry's end
  int lo = INT_MAX, hi = INT_MIN, all_lo = INT_MIN, all_hi = INT_MAX;
  for (int64_t i = first + (threadIdx.x & 31); i < first + kRangeCell && i < last; i += 32) {
    const int a = start[i], b = end[i];
    if (a < b) {
      lo = min(lo, a);
      hi = max(hi, b);
    }
    all_lo = max(all_lo, a);
    all_hi = min(all_hi, b);
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  all_lo = __reduce_max_sync(0xffffffffu, all_lo);
  all_hi = __reduce_min_sync(0xffffffffu, all_hi);
  if ((threadIdx.x & 31) == 0) cells[cell] = make_int4(lo, hi, all_lo, all_hi);
}

// Sets the bit of every key block a slot of `indices` [slots / K][K] names (others name none).
__global__ void __launch_bounds__(kSlotThreads)
    block_bits_kernel(const int32_t* indices, int64_t slots, int64_t per_row, int64_t key_blocks,
                      int64_t words, uint32_t* bits) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kSlotThreads + threadIdx.x;
  if (slot >= slots) return;
  const int kb = indices[slot];
  if (kb < 0 || kb >= key_blocks) return;
  atomicOr(bits + slot / per_row * words + kb / 32, 1u << (kb % 32));
}

unsigned Grid(int64_t items, int per_cta) {
  return static_cast<unsigned>((items + per_cta - 1) / per_cta);
}

}  // namespace

int64_t MaskFormsBytes(const AttentionShape& s) {
  const FormsLayout l(s);
  return l.key_bytes(s) + l.row_bytes(s) + l.bit_bytes();
}

cudaError_t BuildMaskForms(const AttentionShape& s, const int32_t* key_start,
                           const int32_t* key_end, const int32_t* row_start, const int32_t* row_end,
                           const int32_t* block_indices, uint8_t* workspace, MaskForms* forms,
                           cudaStream_t stream) {
  *forms = MaskForms{};
  if (!s.has_mask_forms()) return cudaSuccess;
  const FormsLayout l(s);
  forms->present = true;
  forms->lq = static_cast<int>(s.seqlen_q);
  forms->lk = static_cast<int>(s.seqlen_k);
  // The hulls of `entries` rows of n ranges into `at`; null where the call lacks the form.
  auto range_cells = [&](const int32_t* start, const int32_t* end, int64_t n, int64_t entries,
                         uint8_t* at) -> const int4* {
    if (entries == 0) return nullptr;
    auto* cells = reinterpret_cast<int4*>(at);
    range_cells_kernel<<<Grid(entries * Cells(n), kCellWarps), kCellWarps * 32, 0, stream>>>(
        start, end, n, entries, cells);
    return cells;
  };
  if ((l.key_entries > 0 && (key_start == nullptr || key_end == nullptr)) ||
      (l.row_entries > 0 && (row_start == nullptr || row_end == nullptr))) {
    return cudaErrorInvalidValue;
  }
  forms->key_cells = range_cells(key_start, key_end, s.seqlen_k, l.key_entries, workspace);
  if (forms->key_cells != nullptr) {
    forms->key_start = key_start;
    forms->key_end = key_end;
  }
  workspace += l.key_bytes(s);
  forms->row_cells = range_cells(row_start, row_end, s.seqlen_q, l.row_entries, workspace);
  if (forms->row_cells != nullptr) {
    forms->row_start = row_start;
    forms->row_end = row_end;
  }
  workspace += l.row_bytes(s);
  if (l.block_entries > 0) {
    if (block_indices == nullptr) return cudaErrorInvalidValue;
    auto* bits = reinterpret_cast<uint32_t*>(workspace);
    if (cudaError_t e = cudaMemsetAsync(bits, 0, l.bit_bytes(), stream); e != cudaSuccess) {
      return e;
    }
    const int64_t slots = s.block_indices.num_elements;
    block_bits_kernel<<<Grid(slots, kSlotThreads), kSlotThreads, 0, stream>>>(
        block_indices, slots, s.block_slots, (s.seqlen_k + s.block_k - 1) / s.block_k,
        l.block_words, bits);
    forms->block_bits = bits;
    forms->block_rows = static_cast<int>(l.block_rows);
    forms->block_words = static_cast<int>(l.block_words);
    forms->div_q = FastDiv(static_cast<uint32_t>(s.block_q));
    forms->div_k = FastDiv(static_cast<uint32_t>(s.block_k));
  }
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
