// The spans pass of the segment ids (kernel_params.h: SegmentSpanLayout): one warp per cell of
// kSegmentCell ids, two ids a lane, min and max by warp reductions. The ids are O(L) and read
// once per call, so the attention kernels' walks read 8 bytes per 64 ids instead.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/launch.h"

namespace dmattn::cuda {
namespace {

constexpr int kSpanWarps = 8;
static_assert(kSegmentCell == 64, "two ids a lane");

__global__ void __launch_bounds__(kSpanWarps * 32)
    segment_spans_kernel(const int32_t* q_ids, const int32_t* kv_ids, int64_t lq, int64_t lk,
                         SegmentSpanLayout l, int2* spans) {
  const int64_t q_total = l.rows * l.q_cells;
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kSpanWarps + (threadIdx.x >> 5);
  if (cell >= q_total + l.rows * l.kv_cells) return;  // whole warps only
  const bool is_q = cell < q_total;
  const int64_t rel = is_q ? cell : cell - q_total;
  const int cells = is_q ? l.q_cells : l.kv_cells;
  const int64_t len = is_q ? lq : lk;
  const int64_t row = rel / cells;
  const int64_t first = (rel % cells) * kSegmentCell;
  const int32_t* ids = (is_q ? q_ids : kv_ids) + row * len;
  int lo = INT_MAX, hi = INT_MIN;
  for (int64_t i = first + (threadIdx.x & 31); i < first + kSegmentCell && i < len; i += 32) {
    const int v = ids[i];
    lo = min(lo, v);
    hi = max(hi, v);
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if ((threadIdx.x & 31) == 0) spans[cell] = make_int2(lo, hi);
}

}  // namespace

cudaError_t BuildSegmentSpans(const int32_t* q_ids, const int32_t* kv_ids, int64_t lq, int64_t lk,
                              const SegmentSpanLayout& layout, int2* spans, cudaStream_t stream) {
  const int64_t cells = layout.rows * (layout.q_cells + layout.kv_cells);
  if (cells == 0) return cudaSuccess;
  const int64_t blocks = (cells + kSpanWarps - 1) / kSpanWarps;
  segment_spans_kernel<<<static_cast<unsigned>(blocks), kSpanWarps * 32, 0, stream>>>(
      q_ids, kv_ids, lq, lk, layout, spans);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
