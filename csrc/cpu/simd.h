// An 8-float vector type (GCC vector extensions) for the loops the auto-vectoriser handles badly:
// float reductions (which it may not reorder without -ffast-math) and register transposes. With
// AVX each maps to one register; without, g++ splits it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Built without AVX (a portable -march), g++ warns that returning these vectors changes the ABI.
// They never cross a translation-unit boundary compiled differently, so the warning is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dmattn::cpu {

constexpr int kVecWidth = 8;
typedef float Vec8 __attribute__((vector_size(kVecWidth * sizeof(float))));
typedef int32_t Vec8i __attribute__((vector_size(kVecWidth * sizeof(int32_t))));

inline Vec8 LoadVec(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}
inline void StoreVec(float* p, const Vec8& v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec8 SplatVec(float x) { return Vec8{} + x; }

// Transposes the 8×8 block whose rows are r[0..7] (unpack pairs, then quads, then 128-bit halves:
// 24 shuffles instead of 64 scalar stores).
inline void Transpose8x8(Vec8* r) {
  Vec8 pairs[8], quads[8];
  for (int k = 0; k < 8; k += 2) {
    pairs[k] = __builtin_shuffle(r[k], r[k + 1], Vec8i{0, 8, 1, 9, 4, 12, 5, 13});
    pairs[k + 1] = __builtin_shuffle(r[k], r[k + 1], Vec8i{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int k = 0; k < 8; k += 4)
    for (int j = 0; j < 2; ++j) {
      quads[k + 2 * j] =
          __builtin_shuffle(pairs[k + j], pairs[k + j + 2], Vec8i{0, 1, 8, 9, 4, 5, 12, 13});
      quads[k + 2 * j + 1] =
          __builtin_shuffle(pairs[k + j], pairs[k + j + 2], Vec8i{2, 3, 10, 11, 6, 7, 14, 15});
    }
  for (int k = 0; k < 4; ++k) {
    r[k] = __builtin_shuffle(quads[k], quads[k + 4], Vec8i{0, 1, 2, 3, 8, 9, 10, 11});
    r[k + 4] = __builtin_shuffle(quads[k], quads[k + 4], Vec8i{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

inline int64_t RoundUp(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

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

}  // namespace dmattn::cpu
