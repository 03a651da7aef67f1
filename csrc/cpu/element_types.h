// The three element types of q/k/v/out/bias and their gradients, converted to and from fp32.
//
// All math runs in fp32; these helpers are the only place that knows how fp16 and bf16 are stored.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/params.h"

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
