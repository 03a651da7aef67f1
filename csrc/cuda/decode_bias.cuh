// The decode kernel's bias (decode_kernel.cuh): S starts each key tile as bias / scale, the
// thread's elements read a tile ahead of their use so that their latency hides behind a tile's
// work (harness, B8 Lq16 Lk32k H32/Hk8, a per-key bias over none: +27 % loaded where used, +22 %
// a tile ahead). Two adjacent keys a word, in one load where the bias's rows allow (bias_vec).
// A thread's two rows read one bias row where they are one head's (G divides 8) and the bias is
// broadcast over queries: the per-key bias of GQA decoding. There, with two warps a scheduler
// each issuing about once in five cycles, the time follows the instruction count (ncu, H200:
// benchmarks/results/logs/decode_bias_profile_h200.md), so the row is read, unpacked and
// scaled once for both (the bias's cost 1.27x -> 1.12x there). An MMA adding the bias (the
// group's bias rows as B, each row's factor in its head's columns of A) would take fewer
// instructions still, but multiplies every head's bias by the other heads' zeros: an infinite
// bias element would turn their scores to NaN.
#pragma once

#include "cuda/kernel_params.h"
#include "cuda/kernel_utils.cuh"

namespace dmattn::cuda::detail {

// BN: keys a tile, KW of them a warp's, in NTS = KW / 8 column tiles.
template <int BN, int KW, int NTS, typename T>
class DecodeBias {
  static_assert(NTS * 8 == KW, "8-key column tiles");

 public:
  // rows: the bias rows of the thread's two packed rows (null where a row is not live); key0:
  // the first of its warp's keys in a tile.
  __device__ __forceinline__ DecodeBias(const FwdParams& p, const void* const (&rows)[2], int key0,
                                        int kv_len, int lane)
      : rows_{static_cast<const uint16_t*>(rows[0]), static_cast<const uint16_t*>(rows[1])},
        mode_(p.bias == nullptr ? kNone : rows[0] == rows[1] ? kOneRow : kTwoRows),
        vec_(p.bias_vec),
        col_stride_(p.s.bias.col_stride),
        first_key_(key0 + 2 * (lane & 3)),
        warp_end_(key0 + KW),
        kv_len_(kv_len),
        bias_mul_(p.bias_mul) {}

  __device__ __forceinline__ bool present() const { return mode_ != kNone; }

  // The thread's words of key tile n (keys n * BN + first_key_ + 8 t and the next), into the
  // registers start() reads next.
  __device__ __forceinline__ void load(int n) {
    load_row(0, n);
    if (mode_ == kTwoRows) load_row(1, n);
  }

  // S's start from the words loaded last: bias / scale, zeros without a bias.
  __device__ __forceinline__ void start(float (&sc)[NTS][4]) const {
    if (mode_ == kNone) {
      for_each_element<1, NTS>([&](int, int t, int e) { sc[t][e] = 0.f; });
      return;
    }
    scale_row(sc, 0);
    if (mode_ == kTwoRows) {
      scale_row(sc, 1);
    } else {
      for_each_index<1, NTS, 2>([&](int, int t, int e) { sc[t][2 + e] = sc[t][e]; });
    }
  }

 private:
  enum Mode { kNone, kOneRow, kTwoRows };

  __device__ __forceinline__ void load_row(int half, int n) {
    const uint16_t* bias = rows_[half];
    const int j0 = n * BN + first_key_;
    if (bias != nullptr && vec_ && n * BN + warp_end_ <= kv_len_) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(bias + j0);
#pragma unroll
      for (int t = 0; t < NTS; ++t) words_[half][t] = __ldg(words + t * 4);
      return;
    }
#pragma unroll
    for (int t = 0; t < NTS; ++t) {
      const int j = j0 + t * 8;
      words_[half][t] = 0;
      if (bias == nullptr || j >= kv_len_) continue;
      if (vec_) {
        words_[half][t] = __ldg(reinterpret_cast<const uint32_t*>(bias + j));
      } else {
        words_[half][t] = __ldg(bias + j * col_stride_);
        if (j + 1 < kv_len_) {
          words_[half][t] |= static_cast<uint32_t>(__ldg(bias + (j + 1) * col_stride_)) << 16;
        }
      }
    }
  }

  __device__ __forceinline__ void scale_row(float (&sc)[NTS][4], int half) const {
#pragma unroll
    for (int t = 0; t < NTS; ++t) {
      const float2 x = Elem<T>::unpack_fast(words_[half][t]);
      sc[t][2 * half] = x.x * bias_mul_;
      sc[t][2 * half + 1] = x.y * bias_mul_;
    }
  }

  const uint16_t* rows_[2];
  Mode mode_;
  bool vec_;
  int64_t col_stride_;
  int first_key_;  // the thread's first key in a tile
  int warp_end_;   // one past its warp's last
  int kv_len_;
  float bias_mul_;
  uint32_t words_[2][NTS] = {};
};

}  // namespace dmattn::cuda::detail
