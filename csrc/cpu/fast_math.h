// exp and tanh for the hot loops, written so that g++ -O3 vectorises loops that call them.
//
// std::exp / std::tanh are scalar library calls; these are branch-free arithmetic (Cephes-style
// range reduction + polynomial) that the loop vectoriser turns into a few AVX instructions per 8
// values. They need no -ffast-math: -inf inputs are handled explicitly.
#pragma once

#include <cstdint>
#include <cstring>

namespace dmattn::cpu {

// Below this, e^x is subnormal; we return exactly 0 (and for -inf). Irrelevant for softmax,
// whose largest term is 1.
constexpr float kExpMin = -87.3f;
// Keeps 2^n a normal float; e^x for larger x is never needed (softmax exponents are <= ~0).
constexpr float kExpMax = 88.f;

// e^x with relative error < 1e-7 on [kExpMin, kExpMax]; 0 for x < kExpMin (including -inf).
// Not for NaN inputs (the kernels never produce them).
inline float FastExp(float x) {
  const bool underflow = x < kExpMin;
  x = x < kExpMin ? kExpMin : x;
  x = x > kExpMax ? kExpMax : x;
  // n = round(x / ln 2): adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits.
  constexpr float kRoundMagic = 12582912.f;
  const float t = x * 1.44269504088896341f + kRoundMagic;
  const float n = t - kRoundMagic;
  int32_t t_bits, magic_bits;
  std::memcpy(&t_bits, &t, sizeof(t));
  std::memcpy(&magic_bits, &kRoundMagic, sizeof(kRoundMagic));
  const int32_t pow2n_bits = (t_bits - magic_bits + 127) << 23;
  float pow2n;
  std::memcpy(&pow2n, &pow2n_bits, sizeof(pow2n));
  // r = x - n ln 2 in two steps (Cody-Waite) so that r keeps full precision; |r| <= ln2 / 2.
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // e^r = 1 + r + r^2 P(r), the Cephes expf polynomial.
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r * r + r + 1.f) * pow2n;
  return underflow ? 0.f : y;
}

// tanh(x) with absolute error ~1e-7 and small relative error near 0 (where 1 - 2/(e^2x + 1)
// would cancel).
inline float FastTanh(float x) {
  const float ax = x < 0.f ? -x : x;
  // |x| < 0.625: odd polynomial (Cephes tanhf).
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  // Otherwise 1 - 2 / (e^(2|x|) + 1), with the sign of x; FastExp saturates, giving 1.
  const float e = FastExp(2.f * ax);
  const float large_abs = 1.f - 2.f / (e + 1.f);
  const float large = x < 0.f ? -large_abs : large_abs;
  return ax < 0.625f ? small : large;
}

}  // namespace dmattn::cpu
