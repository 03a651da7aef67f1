// TopkLeave and SumListedKeys (dynamic.h).
#include "cuda/dynamic.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dmattn::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
// 32-key chunks per warp step (16 independent loads per lane in flight). The loop is
// instruction-bound: per chunk one compare, ballot, popc and add; where the window-th beater
// lies is searched once, in the step that holds it.
constexpr int kChunks = 16;
constexpr int kStep = 32 * kChunks;

// Beaters of key j (order key kj) among the 32 x kChunks keys from `base`, chunk by chunk.
template <bool kBeforeJ>
__device__ __forceinline__ void count_beaters(const int32_t (&ki)[kChunks], int32_t kj,
                                              unsigned (&ballot)[kChunks]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    // Ties go to the lower index: keys before j beat it when equal.
    ballot[c] = __ballot_sync(0xffffffffu, kBeforeJ ? ki[c] >= kj : ki[c] > kj);
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    topk_leave_kernel(const int32_t* __restrict__ key, int32_t* __restrict__ leave, int lk,
                      int key_blocks, int window) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x / key_blocks;
  const int j = (blockIdx.x % key_blocks) * kWarpsPerBlock + threadIdx.x / 32;
  if (j >= lk) return;  // warp-uniform
  const int32_t* k = key + row * lk;
  const int32_t kj = k[j];
  int need = window;  // beaters still to come before key j leaves
  int at = lk;
  for (int base = 0; base < lk; base += kStep) {
    int32_t ki[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int i = base + c * 32 + lane;
      ki[c] = i < lk ? k[i] : INT32_MIN;  // past the end: beats nothing
    }
    unsigned ballot[kChunks];
    if (base + kStep <= j) {
      count_beaters<true>(ki, kj, ballot);
    } else if (base > j) {
      count_beaters<false>(ki, kj, ballot);
    } else {  // the step holding j: key j never beats itself
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int i = base + c * 32 + lane;
        ballot[c] = __ballot_sync(0xffffffffu, i < j ? ki[c] >= kj : (i > j && ki[c] > kj));
      }
    }
    int count = 0;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) count += __popc(ballot[c]);
    if (count >= need) {  // the window-th beater is in this step
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int n = __popc(ballot[c]);
        if (need >= 1 && n >= need) at = base + c * 32 + __fns(ballot[c], 0, need);
        need -= n;
      }
      break;
    }
    need -= count;
  }
  if (lane == 0) leave[row * lk + j] = at;
}

// SumListedKeys: one warp per (batch, key, channel). The lanes read the key's slot in 32 of its
// blocks at once; then the warp adds the blocks' rows in block order, lane l owning elements
// l, l + 32, ... of each chunk of kSumChunk.
constexpr int kSumChunk = 256;

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    sum_listed_keys_kernel(const ListedKeysShape s, const ListedKeysArgs a) {
  constexpr int kPerLane = kSumChunk / 32;
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (w >= s.batch * s.seqlen_k * s.channels) return;  // warp-uniform
  const int64_t c = w % s.channels, j = (w / s.channels) % s.seqlen_k;
  const int64_t b = w / (s.channels * s.seqlen_k);
  const int64_t cc = s.key_channels == 1 ? 0 : c;
  const int64_t lk = s.seqlen_k, row = s.channels * s.dim;
  const int32_t* span = a.spans + (b * s.key_channels + cc) * 2 * lk;
  const int32_t* slots = a.slots + (b * s.key_channels + cc) * s.blocks * lk + j;
  const T* grad = static_cast<const T*>(a.grad) + (b * s.blocks * s.slots * s.channels + c) * s.dim;
  T* out = static_cast<T*>(a.out) + ((b * lk + j) * s.channels + c) * s.dim;
  const int n_begin = max(span[j], 0);
  const int n_end = static_cast<int>(min(static_cast<int64_t>(span[lk + j]), s.blocks));
  for (int64_t d0 = 0; d0 < s.dim; d0 += kSumChunk) {
    float acc[kPerLane] = {};
    for (int n0 = n_begin; n0 < n_end; n0 += 32) {
      const int n = n0 + lane;
      const int32_t u = n < n_end ? slots[static_cast<int64_t>(n) * lk] : -1;
      const int64_t offset =
          u >= 0 && u < s.slots ? (static_cast<int64_t>(n) * s.slots + u) * row : -1;
      const int count = min(32, n_end - n0);
#pragma unroll 4
      for (int i = 0; i < count; ++i) {
        const int64_t at = __shfl_sync(0xffffffffu, offset, i);
        if (at < 0) continue;  // warp-uniform
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const int64_t d = d0 + lane + 32 * e;
          if (d < s.dim) acc[e] += static_cast<float>(grad[at + d]);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t d = d0 + lane + 32 * e;
      if (d < s.dim) out[d] = static_cast<T>(acc[e]);
    }
  }
}

template <typename T>
cudaError_t LaunchSumListedKeys(const ListedKeysShape& s, const ListedKeysArgs& a,
                                cudaStream_t stream) {
  const int64_t warps = s.batch * s.seqlen_k * s.channels;
  const int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff || s.blocks > 0x7fffffff - 32) return cudaErrorInvalidConfiguration;
  sum_listed_keys_kernel<T><<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      s, a);
  return cudaGetLastError();
}

constexpr int kMaskSlots = 16;  // per thread: 16-byte stores
constexpr int kMaskRows = 16;   // per thread: one slot chunk's ranges serve this many rows

// Row `row`'s 16 mask bytes for the ranges [f[i], e[i]), packed little-endian into 4 words.
__device__ __forceinline__ uint4 mask_bytes(const int32_t (&f)[kMaskSlots],
                                            const int32_t (&e)[kMaskSlots], int64_t row) {
  uint32_t w[4] = {};
#pragma unroll
  for (int i = 0; i < kMaskSlots; ++i) {
    w[i / 4] |= static_cast<uint32_t>(f[i] <= row && row < e[i]) << (8 * (i % 4));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__global__ void range_mask_kernel(const int32_t* __restrict__ first,
                                  const int32_t* __restrict__ end, bool* __restrict__ mask,
                                  int64_t total, int64_t num_blocks, int64_t block,
                                  int64_t slots) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total) return;
  const int64_t chunks = (slots + kMaskSlots - 1) / kMaskSlots;
  const int64_t row_groups = (block + kMaskRows - 1) / kMaskRows;
  const int64_t u0 = t % chunks * kMaskSlots, r0 = t / chunks % row_groups * kMaskRows;
  const int64_t gn = t / (chunks * row_groups);
  const int64_t row0 = gn % num_blocks * block;
  const int32_t* f = first + gn * slots + u0;
  const int32_t* e = end + gn * slots + u0;
  bool* out = mask + gn * block * slots + u0;
  const int64_t r_end = min(r0 + kMaskRows, block);
  if (slots % kMaskSlots == 0) {  // whole, aligned chunks: 16-byte loads and stores
    int32_t fs[kMaskSlots], es[kMaskSlots];
#pragma unroll
    for (int i = 0; i < kMaskSlots; i += 4) {
      *reinterpret_cast<int4*>(fs + i) = *reinterpret_cast<const int4*>(f + i);
      *reinterpret_cast<int4*>(es + i) = *reinterpret_cast<const int4*>(e + i);
    }
    for (int64_t r = r0; r < r_end; ++r) {
      *reinterpret_cast<uint4*>(out + r * slots) = mask_bytes(fs, es, row0 + r);
    }
    return;
  }
  const int64_t n = min(static_cast<int64_t>(kMaskSlots), slots - u0);
  for (int64_t r = r0; r < r_end; ++r) {
    for (int64_t i = 0; i < n; ++i) out[r * slots + i] = f[i] <= row0 + r && row0 + r < e[i];
  }
}

}  // namespace

cudaError_t RangeMask(const int32_t* first, const int32_t* end, bool* mask, int64_t groups,
                      int64_t num_blocks, int64_t block, int64_t slots, cudaStream_t stream) {
  const int64_t total = groups * ((block + kMaskRows - 1) / kMaskRows) *
                        ((slots + kMaskSlots - 1) / kMaskSlots);
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  range_mask_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      first, end, mask, total, num_blocks, block, slots);
  return cudaGetLastError();
}

cudaError_t SumListedKeys(const ListedKeysShape& shape, const ListedKeysArgs& args,
                          cudaStream_t stream) {
  switch (shape.dtype) {
    case ElementType::kFloat32: return LaunchSumListedKeys<float>(shape, args, stream);
    case ElementType::kFloat16: return LaunchSumListedKeys<__half>(shape, args, stream);
    case ElementType::kBFloat16: return LaunchSumListedKeys<__nv_bfloat16>(shape, args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t TopkLeave(const int32_t* key, int32_t* leave, int64_t rows, int64_t lk, int64_t window,
                      cudaStream_t stream) {
  if (rows == 0 || lk == 0) return cudaSuccess;
  const int64_t key_blocks = (lk + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t blocks = rows * key_blocks;
  if (blocks > 0x7fffffff || lk > 0x7fffffff - kStep) return cudaErrorInvalidConfiguration;
  // A key has at most lk - 1 beaters: a window >= lk never ends.
  const int w = static_cast<int>(window < lk ? window : lk);
  topk_leave_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      key, leave, static_cast<int>(lk), static_cast<int>(key_blocks), w);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
