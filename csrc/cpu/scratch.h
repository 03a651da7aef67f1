// Per-task fp32 scratch tiles, 64-byte aligned so that vector loads never split cache lines.
#pragma once

#include <cstdint>
#include <memory>
#include <new>

namespace dmattn::cpu {

struct AlignedFloatDeleter {
  void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
using FloatBuffer = std::unique_ptr<float[], AlignedFloatDeleter>;

// n uninitialised floats; callers write every element they later read.
inline FloatBuffer AllocateFloats(int64_t n) {
  void* p = ::operator new[](static_cast<size_t>(n > 0 ? n : 1) * sizeof(float),
                             std::align_val_t(64));
  return FloatBuffer(static_cast<float*>(p));
}

}  // namespace dmattn::cpu
