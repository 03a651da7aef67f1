// An 8-float vector type (GCC/Clang vector extension) for the loops the auto-vectoriser handles
// badly: register-blocked GEMM and float reductions (which it may not reorder without
// -ffast-math). Each maps to one AVX register; the code stays portable C++ otherwise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dmattn::cpu {

constexpr int kVecWidth = 8;
typedef float Vec8 __attribute__((vector_size(kVecWidth * sizeof(float))));

inline Vec8 LoadVec(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}
inline void StoreVec(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec8 SplatVec(float x) { return Vec8{} + x; }

inline int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Reductions over n floats, n a multiple of kVecWidth. The order of additions is fixed by n alone,
// so results are bitwise reproducible.
inline float RowMax(const float* x, int64_t n) {
  Vec8 m = SplatVec(-INFINITY);
  for (int64_t c = 0; c < n; c += kVecWidth) {
    const Vec8 v = LoadVec(x + c);
    m = v > m ? v : m;
  }
  float out = m[0];
  for (int k = 1; k < kVecWidth; ++k) out = m[k] > out ? m[k] : out;
  return out;
}

inline float RowSum(const float* x, int64_t n) {
  Vec8 s{};
  for (int64_t c = 0; c < n; c += kVecWidth) s += LoadVec(x + c);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// Σ x[c] * y[c] over n floats, n a multiple of kVecWidth; fixed order as above.
inline float RowDot(const float* x, const float* y, int64_t n) {
  Vec8 s{};
  for (int64_t c = 0; c < n; c += kVecWidth) s += LoadVec(x + c) * LoadVec(y + c);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace dmattn::cpu
