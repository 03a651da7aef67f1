// TopkLeave and SumListedKeys (dynamic.h).
#include "cuda/dynamic.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dmattn::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// TopkLeave: each step a lane makes kLeaveLoads 16-byte loads of 4 keys (1024 keys a step) and
// counts its own beaters; one warp reduction per step tells whether the window-th beater lies in
// it, and only that step locates it. (Per-lane counts take half the instructions of a ballot and
// a popc per 32 keys: the loop is bound by instruction issue.)
constexpr int kLeaveLoads = 8;
constexpr int kLeaveStep = 32 * 4 * kLeaveLoads;
// One warp per block: a warp that scans the whole row (a key of the final top window) holds no
// other warps' slots (8-warp blocks: 36 us at L16k, 1-warp blocks: 33 us on the H200).
constexpr int kLeaveWarps = 1;

// Keys i .. i + 3 of a row of lk keys; past the end INT32_MIN, which beats nothing.
__device__ __forceinline__ int4 load_keys4(const int32_t* k, int i, int lk, bool aligned) {
  if (aligned && i + 4 <= lk) return __ldg(reinterpret_cast<const int4*>(k + i));
  return make_int4(i < lk ? k[i] : INT32_MIN, i + 1 < lk ? k[i + 1] : INT32_MIN,
                   i + 2 < lk ? k[i + 2] : INT32_MIN, i + 3 < lk ? k[i + 3] : INT32_MIN);
}

// Which of the 4 keys from index i beat key j (key kj): bit e for key i + e. Ties go to the
// lower index, and key j never beats itself.
__device__ __forceinline__ unsigned beater_bits(int4 v, int i, int32_t kj, int j) {
  const int32_t x[4] = {v.x, v.y, v.z, v.w};
  unsigned bits = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const bool beats = i + e < j ? x[e] >= kj : (i + e > j && x[e] > kj);
    bits |= static_cast<unsigned>(beats) << e;
  }
  return bits;
}

// How many of the 4 keys beat a key kj that lies after (kAfter: before) all of them.
template <bool kAfter>
__device__ __forceinline__ int count_beaters(int4 v, int32_t kj) {
  if constexpr (kAfter) return (v.x >= kj) + (v.y >= kj) + (v.z >= kj) + (v.w >= kj);
  return (v.x > kj) + (v.y > kj) + (v.z > kj) + (v.w > kj);
}

// The index of the need-th (1-based) beater of key j among the step's keys from `base`, which
// hold at least `need` beaters; lane l holds keys base + (32 ld + l) * 4 + e in v[ld].
__device__ __forceinline__ int locate_beater(const int4 (&v)[kLeaveLoads], int base, int32_t kj,
                                             int j, int need, int lane) {
#pragma unroll
  for (int ld = 0; ld < kLeaveLoads; ++ld) {
    const int i = base + (ld * 32 + lane) * 4;
    const unsigned bits = beater_bits(v[ld], i, kj, j);
    const int c = __popc(bits);
    int upto = c;  // inclusive prefix over lanes
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, upto, d);
      if (lane >= d) upto += y;
    }
    const int total = __shfl_sync(0xffffffffu, upto, 31);
    if (need <= total) {  // warp-uniform
      const int src = __ffs(__ballot_sync(0xffffffffu, upto >= need)) - 1;
      const int before = __shfl_sync(0xffffffffu, upto - c, src);
      const unsigned src_bits = __shfl_sync(0xffffffffu, bits, src);
      return base + (ld * 32 + src) * 4 + static_cast<int>(__fns(src_bits, 0, need - before));
    }
    need -= total;
  }
  return INT32_MAX;  // unreachable: the step holds `need` beaters
}

__global__ void __launch_bounds__(kLeaveWarps * 32)
    topk_leave_kernel(const int32_t* __restrict__ key, int32_t* __restrict__ leave, int lk,
                      int key_blocks, int window) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x / key_blocks;
  const int j = (blockIdx.x % key_blocks) * kLeaveWarps + threadIdx.x / 32;
  if (j >= lk) return;  // warp-uniform
  const int32_t* k = key + row * lk;
  const bool aligned = (reinterpret_cast<uintptr_t>(k) & 15) == 0;
  const int32_t kj = k[j];
  int need = window;  // beaters still to come before key j leaves
  int at = lk;
  for (int base = 0; base < lk; base += kLeaveStep) {
    int4 v[kLeaveLoads];
#pragma unroll
    for (int ld = 0; ld < kLeaveLoads; ++ld) {
      v[ld] = load_keys4(k, base + (ld * 32 + lane) * 4, lk, aligned);
    }
    int mine[kLeaveLoads];  // independent sums: no chain of dependent adds
    if (base + kLeaveStep <= j) {
#pragma unroll
      for (int ld = 0; ld < kLeaveLoads; ++ld) mine[ld] = count_beaters<true>(v[ld], kj);
    } else if (base > j) {
#pragma unroll
      for (int ld = 0; ld < kLeaveLoads; ++ld) mine[ld] = count_beaters<false>(v[ld], kj);
    } else {  // the step holding key j
#pragma unroll
      for (int ld = 0; ld < kLeaveLoads; ++ld) {
        mine[ld] = __popc(beater_bits(v[ld], base + (ld * 32 + lane) * 4, kj, j));
      }
    }
#pragma unroll
    for (int width = kLeaveLoads / 2; width > 0; width /= 2)
#pragma unroll
      for (int ld = 0; ld < width; ++ld) mine[ld] += mine[ld + width];
    const int count = static_cast<int>(__reduce_add_sync(0xffffffffu, mine[0]));
    if (count >= need) {
      at = locate_beater(v, base, kj, j, need, lane);
      break;
    }
    need -= count;
  }
  if (lane == 0) leave[row * lk + j] = at;
}

// SumListedKeys: one warp per (batch, key, channel). The lanes read the key's slot in 32 of its
// blocks at once. Wide rows (dim > kSmallDim): lane l owns elements 4l .. 4l + 3 of each chunk of
// kSumChunk, and the rows of kSumBatch blocks load at once (a key listed by all 32 blocks of the
// L16k suite waited on 32 loads in a row before). Narrow rows (the dbias of a per-key bias):
// lane l adds the rows of blocks l, l + 32, ..., then one warp reduction.
constexpr int kSumVec = 4;
constexpr int kSumChunk = 32 * kSumVec;
constexpr int kSumBatch = 8;
constexpr int kSmallDim = 8;

// Elements d .. d + 3 of a row as float (0 past `valid`); one vector load when `vec`.
template <typename T>
__device__ __forceinline__ void load_vec4(const T* p, int valid, bool vec, float (&v)[kSumVec]) {
  if (vec && valid == kSumVec) {
    if constexpr (sizeof(T) == 4) {
      const float4 x = *reinterpret_cast<const float4*>(p);
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(p);
      const T* h = reinterpret_cast<const T*>(&x);
#pragma unroll
      for (int e = 0; e < kSumVec; ++e) v[e] = static_cast<float>(h[e]);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < kSumVec; ++e) v[e] = e < valid ? static_cast<float>(p[e]) : 0.f;
}

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    sum_listed_keys_kernel(const ListedKeysShape s, const ListedKeysArgs a, bool vec) {
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
  // Offset of block n's row of this key (-1: not listed there).
  auto row_of = [&](int n) -> int64_t {
    const int32_t u = n < n_end ? slots[static_cast<int64_t>(n) * lk] : -1;
    return u >= 0 && u < s.slots ? (static_cast<int64_t>(n) * s.slots + u) * row : -1;
  };

  if (s.dim <= kSmallDim) {
    float acc[kSmallDim] = {};
    for (int n = n_begin + lane; n < n_end; n += 32) {
      const int64_t at = row_of(n);
      if (at < 0) continue;
#pragma unroll
      for (int d = 0; d < kSmallDim; ++d) {
        if (d < s.dim) acc[d] += static_cast<float>(grad[at + d]);
      }
    }
#pragma unroll
    for (int d = 0; d < kSmallDim; ++d) {
      float x = acc[d];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
      if (lane == 0 && d < s.dim) out[d] = static_cast<T>(x);
    }
    return;
  }

  for (int64_t d0 = 0; d0 < s.dim; d0 += kSumChunk) {
    const int64_t d = d0 + lane * kSumVec;
    const int valid = static_cast<int>(max(min(s.dim - d, static_cast<int64_t>(kSumVec)),
                                           static_cast<int64_t>(0)));
    float acc[kSumVec] = {};
    for (int n0 = n_begin; n0 < n_end; n0 += 32) {
      const int64_t offset = row_of(n0 + lane);
      const int count = min(32, n_end - n0);
      for (int i0 = 0; i0 < count; i0 += kSumBatch) {
        float v[kSumBatch][kSumVec];
#pragma unroll
        for (int i = 0; i < kSumBatch; ++i) {
          const int64_t at = __shfl_sync(0xffffffffu, offset, (i0 + i) & 31);
          const bool listed = i0 + i < count && at >= 0;
          load_vec4(grad + (listed ? at + d : 0), listed ? valid : 0, vec, v[i]);
        }
#pragma unroll
        for (int i = 0; i < kSumBatch; ++i)
#pragma unroll
          for (int e = 0; e < kSumVec; ++e) acc[e] += v[i][e];
      }
    }
#pragma unroll
    for (int e = 0; e < kSumVec; ++e) {
      if (e < valid) out[d + e] = static_cast<T>(acc[e]);
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
  // Vector loads: rows of whole 4-element groups on an aligned base.
  const bool vec = s.dim % kSumVec == 0 &&
                   reinterpret_cast<uintptr_t>(a.grad) % (kSumVec * sizeof(T)) == 0;
  sum_listed_keys_kernel<T><<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      s, a, vec);
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
  const int64_t key_blocks = (lk + kLeaveWarps - 1) / kLeaveWarps;
  const int64_t blocks = rows * key_blocks;
  if (blocks > 0x7fffffff || lk > 0x7fffffff - kLeaveStep) return cudaErrorInvalidConfiguration;
  // A key has at most lk - 1 beaters: a window >= lk never ends.
  const int w = static_cast<int>(window < lk ? window : lk);
  topk_leave_kernel<<<static_cast<unsigned>(blocks), kLeaveWarps * 32, 0, stream>>>(
      key, leave, static_cast<int>(lk), static_cast<int>(key_blocks), w);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
