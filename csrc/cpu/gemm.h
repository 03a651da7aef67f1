// The one matrix product of the kernels: C += A · B on small fp32 tiles.
//
// Every product of the forward and backward (Q·Kᵀ, P·V, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K) is written as
// C[M×N] += A[M×K] · B[K×N] with B and C row-major (contiguous along N) and A read through two
// strides, so a transposed A (Pᵀ, dSᵀ) costs nothing. The micro-kernel keeps a block of C in
// registers and streams rows of B, broadcasting one A element per row of C. Plain loops are not
// register-blocked this way by g++, hence the vector types.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

namespace dmattn::cpu {

constexpr int64_t kGemmRows = 4;  // M must be a multiple of this

// The micro-kernel works in the machine's own vector width (8 floats with AVX, 4 in a portable
// SSE-only build, where 8-float vectors would be split and spilled), with kGemmVecs vectors per C
// row: AVX-512 machines have 32 vector registers, room for a 4×32 block (16 accumulators); AVX
// and SSE have 16, so 4×16 or 4×8 (8 accumulators).
#if defined(__AVX__)
constexpr int kGemmLanes = 8;
#else
constexpr int kGemmLanes = 4;
#endif
#if defined(__AVX512F__)
constexpr int kGemmVecs = 4;
#else
constexpr int kGemmVecs = 2;
#endif
typedef float GemmVec __attribute__((vector_size(kGemmLanes * sizeof(float))));

template <int kVecs>
inline void GemmMicroKernel(int64_t K, const float* __restrict a, int64_t a_row, int64_t a_col,
                            const float* __restrict b, int64_t ldb, float* __restrict c,
                            int64_t ldc) {
  GemmVec acc[kGemmRows][kVecs];
  for (int m = 0; m < kGemmRows; ++m)
    for (int v = 0; v < kVecs; ++v)
      std::memcpy(&acc[m][v], c + m * ldc + v * kGemmLanes, sizeof(GemmVec));
  for (int64_t k = 0; k < K; ++k) {
    GemmVec b_row[kVecs];
    for (int v = 0; v < kVecs; ++v)
      std::memcpy(&b_row[v], b + k * ldb + v * kGemmLanes, sizeof(GemmVec));
    for (int m = 0; m < kGemmRows; ++m) {
      const float a_mk = a[m * a_row + k * a_col];
      for (int v = 0; v < kVecs; ++v) acc[m][v] += a_mk * b_row[v];
    }
  }
  for (int m = 0; m < kGemmRows; ++m)
    for (int v = 0; v < kVecs; ++v)
      std::memcpy(c + m * ldc + v * kGemmLanes, &acc[m][v], sizeof(GemmVec));
}

// C[m][n] += Σ_k A(m, k) · B[k][n] for m < M, n < N, with A(m, k) = a[m * a_row + k * a_col].
// M must be a multiple of kGemmRows and N of kVecWidth.
inline void GemmAccumulate(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_row,
                           int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc) {
  constexpr int64_t kWide = kGemmVecs * kGemmLanes;
  for (int64_t m = 0; m < M; m += kGemmRows) {
    const float* a_m = a + m * a_row;
    float* c_m = c + m * ldc;
    int64_t n = 0;
    for (; n + kWide <= N; n += kWide)
      GemmMicroKernel<kGemmVecs>(K, a_m, a_row, a_col, b + n, ldb, c_m + n, ldc);
    for (; n < N; n += kGemmLanes)
      GemmMicroKernel<1>(K, a_m, a_row, a_col, b + n, ldb, c_m + n, ldc);
  }
}

}  // namespace dmattn::cpu
