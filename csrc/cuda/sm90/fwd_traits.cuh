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

#include "cuda/sm90/sync.cuh"

namespace dmattn::cuda::sm90 {

// Bytes of a slot of the tile queue (fwd_scheduler.cuh: QueuedTile).
constexpr uint32_t kQueuedTileBytes = 64;

// kOperands: the CTA has rings for the bias and mask tiles of the key blocks and walks past the
// blocks a mask hides (a call with a mask or a bias); kBias: it has the bias ring (calls with a
// mask alone leave its shared memory to a second mask stage and O's own tile). kSegments: it
// reads segment ids (kernels of their own: their walk's state would cost the others' consumers
// registers); kTable: a window table (likewise: its rule and the sink's gap; never with ids:
// calls with both run the FlashAttention-2-class forward).
// kGate: the gate (gate.cuh; kernels of their own, without the operand rings, segment ids or
// window tables): each key block's delta rides with its V tile, and the walks pass over the
// blocks of the gate threshold's grid that it drops (the tiles nest in the grid's blocks).
// kThreshold: softmax-threshold skipping (fwd_threshold.cuh; kernels of their own, without the
// gate, segment ids or window tables): the walks go up the key blocks, as the rule visits them,
// and each consumer warpgroup decides on its 64 rows' blocks of the rule's grid.
// kForms: block indices whose blocks hold each warpgroup's rows of a tile (mask_forms.cuh; kernels
// of their own, without the operand rings, segment ids, window tables, the gate or a threshold):
// the walks skip the tiles the forms' summaries hide, and a warpgroup passes those that only the
// other's rows see; every block it computes is whole, so no score is tested. (Testing the scores
// of partly listed tiles in the consumers took them to 56 spill stores.)
// kProducerRegs_ / kConsumerRegs_: setmaxnreg budgets other than the defaults below (0: the
// default), for tuning builds.
template <int D_, int BN_, int kConsumers_ = 2, bool kOperands_ = false, int kProducerRegs_ = 0,
          int kConsumerRegs_ = 0, bool kSegments_ = false, bool kBias_ = kOperands_,
          bool kTable_ = false, bool kGate_ = false, bool kThreshold_ = false,
          bool kForms_ = false>
struct FwdTraits {
  static constexpr int D = D_, BN = BN_, kConsumers = kConsumers_;
  static constexpr bool kOperands = kOperands_, kSegments = kSegments_, kTable = kTable_;
  static constexpr bool kGate = kGate_, kThreshold = kThreshold_, kForms = kForms_;
  // The direction of the key walks: down from the last block, or up with a threshold.
  static constexpr int kKeyStep = kThreshold ? 1 : -1;
  static constexpr bool kBias = kOperands && kBias_;
  static constexpr int BM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // K / V ring slots. Block-index kernels on 64-key tiles take four: a warpgroup computes only
  // its own query block's blocks of the tiles it walks, so a slot turns over in half the time
  // of a 128-key tile's while its load's latency stays (H200, L16k H16 D128, 64 x 64 blocks top
  // 16 of 256: forward 0.502 -> 0.478 ms, causal 0.294 -> 0.277; three slots 0.484). At 128 keys
  // a third slot, O then staged in Q's tile, made them 1.6 % slower.
  static constexpr int kStages = kForms && BN == 64 ? 4 : 2;
  // setmaxnreg budgets per thread: the warpgroups share what the CTA got at launch (the
  // __launch_bounds__ cap, 65536 / kThreads rounded down to 8, per thread), or setmaxnreg.inc
  // waits forever: 24 + 2 x 240 (of 3 x 168) or 32 + 3 x 160 (of 4 x 128). With 224 for two
  // consumers ptxas reports no spill either (H100 harness, dense D128 L4k 0.890 vs 0.883 ms at
  // 240). Every spill of the kernels is the producer's, at 24 (its mask map walk and tile
  // bookkeeping). The D <= 128 kernels with a bias ring take 56 + 2 x 224: their producer and
  // operand warps then spill 37 instructions instead of 395, their consumers none (H100 harness,
  // bias + 50 % mask 0.697 -> 0.692 ms, all-true mask 0.648 -> 0.645; other budgets:
  // tests/cuda/tune_fwd.cu). The gated D <= 128 kernels too: at 24 their producer (the gate
  // filter, the delta loads) spilled 228 instructions, at 56 none (sm_90a D = 128), and the
  // block-index kernels (the forms' walk): 560 bytes of spill stores at 24, none at 56.
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static constexpr bool kWideProducer = kConsumers == 2 && (kBias || kGate || kForms) && D <= 128;
  static constexpr int kProducerRegs =
      kProducerRegs_ ? kProducerRegs_ : kConsumers == 3 ? 32 : kWideProducer ? 56 : 24;
  static constexpr int kConsumerRegs =
      kConsumerRegs_ ? kConsumerRegs_ : kConsumers == 3 ? 160 : kWideProducer ? 224 : 240;
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0, "setmaxnreg: multiples of 8");
  static_assert(kProducerRegs + kConsumers * kConsumerRegs <=
                    (kConsumers + 1) * (65536 / kThreads / 8 * 8),
                "register budgets within the CTA's launch allocation");

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
  // The operand rings: kBiasStages bias tiles (BM x BN, 16-bit, 64-column panels in the 128-byte
  // swizzle, or one plain row for a bias broadcast over queries), kMaskStages tiles of the mask's
  // bits (BM plain rows of BN / 8 = 16 bytes, or one row). A full-size bias streams from memory
  // at about the rate the GEMMs take it, so its tile loads a block ahead (two stages); the
  // mask's second stage, where it fits (not at D = 128 with a bias), hides its short loads.
  static constexpr uint32_t kBiasBytes = kBias ? BM * BN * 2 : 0;
  static constexpr uint32_t kMaskBytes = kOperands ? BM * BN / 8 : 0;
  static constexpr uint32_t kOffBias = kOffV + kStages * kKVBytes;
  static constexpr int kBiasStages = 2;
  static constexpr int kMaskStages =
      kOffBias + kBiasStages * kBiasBytes + 2 * kMaskBytes + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr uint32_t kOffMask = kOffBias + kBiasStages * kBiasBytes;
  // The gate's delta of each ring slot's key block (BN floats; none without the gate).
  static constexpr uint32_t kDeltaBytes = kGate ? BN * 4 : 0;
  static constexpr uint32_t kOffDelta = kOffMask + kMaskStages * kMaskBytes;
  static constexpr uint32_t kEndOperands = kOffDelta + kStages * kDeltaBytes;
  // O is staged in a tile of its own where it fits (the next tile's Q then loads during the
  // epilogue), else in Q's tile, which is released only once the store has read it. (Storing
  // that O from the registers instead, Q released at once, was slower: H200, D = 256 L4k 0.402
  // -> 0.417 ms, bias + 50 % mask 0.859 -> 0.883.)
  static constexpr bool kOutputInQ = kEndOperands + kQBytes + 1024 > 227 * 1024;
  static constexpr uint32_t kOffO = kOutputInQ ? kOffQ : kEndOperands;
  static constexpr uint32_t kOffBarriers = kOutputInQ ? kEndOperands : kOffO + kQBytes;
  // q_full, q_empty, then k_full, k_empty, v_full, v_empty per slot, then the tile queue's
  // full and empty per slot (fwd_scheduler.cuh), then bias_full, bias_empty, mask_full,
  // mask_empty per slot of theirs, then the queue's tiles
  static constexpr int kTileSlots = 2;
  static constexpr int kBarriers =
      2 + 4 * kStages + 2 * kTileSlots + 2 * kBiasStages + 2 * kMaskStages;
  static constexpr uint32_t kOffTileSlots = kOffBarriers + kBarriers * 8;
  static constexpr uint32_t kSmem = kOffTileSlots + kTileSlots * kQueuedTileBytes;
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0 && kBiasBytes % 1024 == 0 &&
                    kMaskBytes % 1024 == 0,
                "tiles on 1024-byte boundaries (the swizzle is a function of the address)");
  static_assert(!kOperands || BN == 128, "a row of a mask tile is one 16-byte unit of bits");
  static_assert(kSmem <= 227 * 1024, "shared memory of one Hopper CTA");
  static_assert(!kGate || (kGateBlockQ % BM == 0 && kGateBlockK % BN == 0),
                "gated tiles nest in the gate threshold's grid");
  static_assert(!kGate || (!kOperands && !kSegments && !kTable),
                "gated kernels read no mask, bias, segment ids or window table");
  static_assert(!kThreshold || (!kGate && !kSegments && !kTable && kConsumers == 2 &&
                                BN == kSkipBlockK && 64 == kSkipBlockQ),
                "threshold kernels: a warpgroup's 64 rows and a key block are one block of the "
                "rule's grid; no gate, segment ids, window table or third consumer");
  static_assert(!kForms || (!kOperands && !kSegments && !kTable && !kGate && !kThreshold),
                "block-index kernels: no mask, bias, segment ids, window table, gate or threshold");
  static_assert(!kForms || kConsumers == 2,
                "block-index kernels: each warpgroup's 64 rows in one block (BlockIndicesHoldTiles)");
  // A slot's V is full once its TMA bytes (the producer's arrival) and, in gated kernels, its
  // delta (an arrival of each producer lane once its cp.async has landed) are in.
  static constexpr int kVFullArrivals = kGate ? 1 + 32 : 1;

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
  __device__ __forceinline__ uint64_t* bias_full(int slot) const {
    return base + 2 + 4 * Tr::kStages + 2 * Tr::kTileSlots + slot;
  }
  __device__ __forceinline__ uint64_t* bias_empty(int slot) const {
    return bias_full(Tr::kBiasStages) + slot;
  }
  __device__ __forceinline__ uint64_t* mask_full(int slot) const {
    return bias_full(2 * Tr::kBiasStages) + slot;
  }
  __device__ __forceinline__ uint64_t* mask_empty(int slot) const {
    return mask_full(Tr::kMaskStages) + slot;
  }
};

// The positions in the bias and mask rings (each advances only for blocks that load its tile).
template <typename Tr>
struct OperandRings {
  RingPos<Tr::kBiasStages> bias;
  RingPos<Tr::kMaskStages> mask;
};

// Named barrier ids (0 is __syncthreads'): the consumers' turns at issuing wgmmas, each consumer
// warpgroup's epilogue and its threshold votes.
constexpr int kTurnBarrier = 1;       // + consumer index
constexpr int kEpilogueBarrier = 4;   // + consumer index
constexpr int kVoteBarrier = 7;       // + consumer index (fwd_threshold.cuh)

}  // namespace dmattn::cuda::sm90
