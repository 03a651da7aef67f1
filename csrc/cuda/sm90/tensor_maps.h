// TMA descriptors (host) of the Hopper kernels' operands.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace dmattn::cuda::sm90 {

// `base` viewed as [entries, rows, heads, head_dim] (q, out: [batch, Lq, H, D]; k, v: [distinct
// batch entries, Lk, Hk, D]), read or written in boxes of 64 columns x 1 head x box_rows rows x
// 1 entry with the 128-byte swizzle (a box is one SwizzledTile panel); out-of-bounds rows load as
// zeros and are not stored. cudaErrorNotSupported when the driver or the shape cannot take it
// (base not 16-byte aligned, a dimension past TMA's limits).
cudaError_t EncodeRowMajorMap(CUtensorMap* map, const void* base, ElementType dtype,
                              int64_t entries, int64_t rows, int64_t heads, int64_t head_dim,
                              int box_rows);

// A bias (16-bit `dtype`) or the mask's bits (bytes) viewed as [batch entries, head entries,
// rows, cols] (its own contiguous shape, a broadcast dim of size 1; rows of row_bytes, a
// multiple of 16), in boxes of box_cols x box_rows x 1 x 1. With `swizzle`, rows of 128 bytes in
// the 128-byte swizzle (box_cols * element bytes == 128), else plain rows. Out-of-bounds
// elements load as zeros.
cudaError_t EncodeOperandMap(CUtensorMap* map, const void* base, int element_bytes,
                             ElementType dtype, int64_t batch_entries, int64_t head_entries,
                             int64_t rows, int64_t cols, int64_t row_bytes, int box_cols,
                             int box_rows, bool swizzle);

// A float32 vector of `elems` elements (lse, D of the backward: [batch, heads, rows] read as one
// flat vector) in boxes of `box` elements; elements past its end load as zeros.
cudaError_t EncodeVectorMap(CUtensorMap* map, const float* base, int64_t elems, int box);

}  // namespace dmattn::cuda::sm90
