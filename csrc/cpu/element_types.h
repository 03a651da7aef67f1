// The three element types of q/k/v/out/bias and their gradients, converted to and from fp32.
//
// All math runs in fp32; these helpers are the only place that knows how fp16 and bf16 are stored.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "common/params.h"
#include "cpu/simd.h"

namespace dmattn::cpu {

// g++ 12 on x86-64 knows _Float16 (conversions use F16C when -march enables it).
using Float16 = _Float16;

// bfloat16: the upper 16 bits of a float32.
struct BFloat16 {
  uint16_t bits;
};

inline float ToFloat(float x) { return x; }
inline float ToFloat(Float16 x) { return static_cast<float>(x); }
inline float ToFloat(BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
T FromFloat(float x);

template <>
inline float FromFloat<float>(float x) {
  return x;
}

template <>
inline Float16 FromFloat<Float16>(float x) {
  return static_cast<Float16>(x);  // round to nearest even
}

template <>
inline BFloat16 FromFloat<BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{0x7fc0};  // NaN stays a (quiet) NaN
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate.
  u += 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

// Eight consecutive elements as floats, in vector registers (the tile loaders' inner step).
inline Vec8 LoadAsFloats(const float* p) { return LoadVec(p); }

inline Vec8 LoadAsFloats(const Float16* p) {
#if defined(__F16C__)
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec8>(_mm256_cvtph_ps(halves));
#else
  Vec8 v;
  for (int k = 0; k < kVecWidth; ++k) v[k] = ToFloat(p[k]);
  return v;
#endif
}

inline Vec8 LoadAsFloats(const BFloat16* p) {
  typedef uint16_t U16x8 __attribute__((vector_size(16)));
  typedef uint32_t U32x8 __attribute__((vector_size(32)));
  U16x8 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const U32x8 wide = __builtin_convertvector(bits, U32x8) << 16;
  Vec8 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with T the storage type of `dtype`.
template <typename Fn>
void DispatchElementType(ElementType dtype, Fn&& fn) {
  switch (dtype) {
    case ElementType::kFloat32:
      fn(TypeTag<float>{});
      break;
    case ElementType::kFloat16:
      fn(TypeTag<Float16>{});
      break;
    case ElementType::kBFloat16:
      fn(TypeTag<BFloat16>{});
      break;
  }
}

}  // namespace dmattn::cpu
