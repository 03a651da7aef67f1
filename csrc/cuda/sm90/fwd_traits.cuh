// Tile shape, thread roles, register split and shared-memory layout of the warp-specialised
// Hopper forward (sm90/fwd_kernel.cuh).
//
// A CTA is one producer warpgroup (one thread issues every TMA load) and kConsumers consumer
// warpgroups of 64 query rows each: BM = 64 kConsumers query rows of one (batch, head) against
// BN-key blocks of K and V that stream through a ring of kStages slots. Every 16-bit operand
// tile is stored as 64-column panels of 128-byte rows in the hardware's 128-byte swizzle
// (SwizzledTile, the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and wgmma reads).
#pragma once

#include <cstdint>

namespace dmattn::cuda::sm90 {

template <int D_, int BN_, int kConsumers_ = 2>
struct FwdTraits {
  static constexpr int D = D_, BN = BN_, kConsumers = kConsumers_;
  static constexpr int BM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = 2;
  // setmaxnreg budgets per thread: 24 + 2 x 240 or 32 + 3 x 160 fill the SM's 64K registers
  // (128 threads per warpgroup).
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kProducerRegs + kConsumers * kConsumerRegs <= 512, "register file");

  static constexpr int kPanels = D / 64;                     // 64-column panels of a tile
  static constexpr int NTS = BN / 8;                         // 8-column tiles of S
  static constexpr int NTO = D / 8;                          // 8-column tiles of O
  static constexpr int kChunkO = D % 128 == 0 ? 128 : 64;    // wgmma N of the P V GEMM
  static_assert(D % 64 == 0 && D <= 256, "head dims of whole 64-column panels");
  static_assert(BN == 64 || BN == 128, "wgmma N of the Q K^T GEMM");

  static constexpr uint32_t kQBytes = BM * D * 2;
  static constexpr uint32_t kKVBytes = BN * D * 2;
  static constexpr uint32_t kOffQ = 0;
  static constexpr uint32_t kOffK = kOffQ + kQBytes;
  static constexpr uint32_t kOffV = kOffK + kStages * kKVBytes;
  // O is staged in a tile of its own where it fits (the next tile's Q then loads during the
  // epilogue), else in Q's tile, which is released only once the store has read it (D = 256).
  static constexpr bool kOutputInQ = kOffV + (kStages + 1) * kKVBytes + kQBytes > 227 * 1024;
  static constexpr uint32_t kOffO = kOutputInQ ? kOffQ : kOffV + kStages * kKVBytes;
  static constexpr uint32_t kOffBarriers =
      kOutputInQ ? kOffV + kStages * kKVBytes : kOffO + kQBytes;
  // q_full, q_empty, then k_full, k_empty, v_full, v_empty per slot, then the tile queue's
  // full and empty per slot (fwd_scheduler.cuh), then the queue's tile indices
  static constexpr int kTileSlots = 2;
  static constexpr int kBarriers = 2 + 4 * kStages + 2 * kTileSlots;
  static constexpr uint32_t kOffTileSlots = kOffBarriers + kBarriers * 8;
  static constexpr uint32_t kSmem = kOffTileSlots + kTileSlots * 8;
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0,
                "operands on 1024-byte boundaries (the swizzle is a function of the address)");
  static_assert(kSmem <= 227 * 1024, "shared memory of one Hopper CTA");

  // Every consumer warp releases a ring slot (and Q) once its wgmmas have read it.
  static constexpr int kReleaseArrivals = 4 * kConsumers;
};

// The ring's barriers, carved from the end of the CTA's shared memory.
template <typename Tr>
struct FwdBarriers {
  uint64_t* base;
  __device__ __forceinline__ uint64_t* q_full() const { return base; }
  __device__ __forceinline__ uint64_t* q_empty() const { return base + 1; }
  __device__ __forceinline__ uint64_t* k_full(int slot) const { return base + 2 + slot; }
  __device__ __forceinline__ uint64_t* k_empty(int slot) const {
    return base + 2 + Tr::kStages + slot;
  }
  __device__ __forceinline__ uint64_t* v_full(int slot) const {
    return base + 2 + 2 * Tr::kStages + slot;
  }
  __device__ __forceinline__ uint64_t* v_empty(int slot) const {
    return base + 2 + 3 * Tr::kStages + slot;
  }
  __device__ __forceinline__ uint64_t* tile_full() const { return base + 2 + 4 * Tr::kStages; }
  __device__ __forceinline__ uint64_t* tile_empty() const {
    return base + 2 + 4 * Tr::kStages + Tr::kTileSlots;
  }
};

// Named barrier ids (0 is __syncthreads'): the consumers' turns at issuing wgmmas, and each
// consumer warpgroup's epilogue.
constexpr int kTurnBarrier = 1;       // + consumer index
constexpr int kEpilogueBarrier = 4;   // + consumer index

}  // namespace dmattn::cuda::sm90
