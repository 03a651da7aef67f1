// Loading operand tiles into fp32 scratch: conversion from the element type, the scale folded
// in, zero padding up to the GEMM extents, and the key-minor (transposed) layout of K and V.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/element_types.h"
#include "cpu/simd.h"

namespace dmattn::cpu {

// dst[r][d] = scale * src[r][d] for r < rows, d < dim (src rows src_stride apart); zeros in the
// rest of the padded_rows × ld tile.
template <typename T>
void LoadRows(const T* src, int64_t src_stride, int64_t rows, int64_t dim, float scale,
              float* dst, int64_t ld, int64_t padded_rows) {
  for (int64_t r = 0; r < padded_rows; ++r) {
    float* d = dst + r * ld;
    int64_t c = 0;
    if (r < rows) {
      const T* s = src + r * src_stride;
      for (; c + kVecWidth <= dim; c += kVecWidth) StoreVec(d + c, scale * LoadAsFloats(s + c));
      for (; c < dim; ++c) d[c] = scale * ToFloat(s[c]);
    }
    for (; c < ld; ++c) d[c] = 0.f;
  }
}

// dst[d][c] = src[c][d] for c < cols, d < dim (a K or V tile stored key-minor, so that score
// rows are axpy loops over contiguous keys); zeros for c in [cols, padded_cols). Works on 8×8
// blocks transposed in registers; padded_cols must be a multiple of 8.
template <typename T>
void LoadTransposed(const T* src, int64_t src_stride, int64_t cols, int64_t dim, float* dst,
                    int64_t ld, int64_t padded_cols) {
  for (int64_t c0 = 0; c0 < padded_cols; c0 += kVecWidth) {
    for (int64_t d0 = 0; d0 < dim; d0 += kVecWidth) {
      const int64_t dims = std::min<int64_t>(kVecWidth, dim - d0);
      Vec8 block[kVecWidth];
      for (int k = 0; k < kVecWidth; ++k) {
        const T* s = src + (c0 + k) * src_stride + d0;
        if (c0 + k >= cols) {
          block[k] = Vec8{};
        } else if (dims == kVecWidth) {
          block[k] = LoadAsFloats(s);
        } else {
          block[k] = Vec8{};
          for (int64_t d = 0; d < dims; ++d) block[k][d] = ToFloat(s[d]);
        }
      }
      Transpose8x8(block);
      for (int64_t d = 0; d < dims; ++d) StoreVec(dst + (d0 + d) * ld + c0, block[d]);
    }
  }
}

}  // namespace dmattn::cpu
