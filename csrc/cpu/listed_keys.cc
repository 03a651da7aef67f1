// SumListedKeys (cpu/attention.h): one task per (batch, key), its blocks in order.
#include <algorithm>
#include <vector>

#include "cpu/attention.h"
#include "cpu/element_types.h"

namespace dmattn::cpu {
namespace {

template <typename T>
void SumListedKeysTyped(const ListedKeysShape& s, const ListedKeysArgs& a,
                        const ParallelFor& parallel_for) {
  const T* grad = static_cast<const T*>(a.grad);
  T* out = static_cast<T*>(a.out);
  const int64_t C = s.channels, D = s.dim, U = s.slots, Lk = s.seqlen_k;
  parallel_for(s.batch * Lk, [&](int64_t task) {
    const int64_t b = task / Lk, j = task % Lk;
    std::vector<float> acc(D);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t cc = s.key_channels == 1 ? 0 : c;
      const int32_t* span = a.spans + (b * s.key_channels + cc) * 2 * Lk;
      const int32_t* slots = a.slots + (b * s.key_channels + cc) * s.blocks * Lk;
      const int64_t n_begin = std::max<int64_t>(span[j], 0);
      const int64_t n_end = std::min<int64_t>(span[Lk + j], s.blocks);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t n = n_begin; n < n_end; ++n) {
        const int64_t u = slots[n * Lk + j];
        if (u < 0 || u >= U) continue;
        const T* g = grad + (((b * s.blocks + n) * U + u) * C + c) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += ToFloat(g[d]);
      }
      T* o = out + ((b * Lk + j) * C + c) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = FromFloat<T>(acc[d]);
    }
  });
}

}  // namespace

void SumListedKeys(const ListedKeysShape& shape, const ListedKeysArgs& args,
                   const ParallelFor& parallel_for) {
  switch (shape.dtype) {
    case ElementType::kFloat32: return SumListedKeysTyped<float>(shape, args, parallel_for);
    case ElementType::kFloat16: return SumListedKeysTyped<Float16>(shape, args, parallel_for);
    case ElementType::kBFloat16: return SumListedKeysTyped<BFloat16>(shape, args, parallel_for);
  }
}

}  // namespace dmattn::cpu
