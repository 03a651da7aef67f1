// Tile shape, thread roles, register split and shared-memory layout of the warp-specialised
// Hopper backward (sm90/bwd_kernel.cuh), and its parameter block.
//
// A CTA owns one block of BN = 128 keys of one kv head (and dk / dv class) and walks the query
// blocks of BM = 64 rows that see it. Warpgroup 0 is the producer: warp 0 TMA-loads K and V once
// and Q, dO (with their lse and D rows, mask bits and bias tile) of each query block into a
// two-slot ring; warp 1 (warps 1 and 2 in turn, deterministic) adds each block's dQ stage to the
// fp32 accumulator with one bulk reduction (and stores a full-size dbias from the dS tile).
// Warpgroups 1 and 2 are the consumers, 64 keys each: S^T, dP^T, dV and dK of their keys, and dQ
// of half the head dim over all 128 keys (the two warpgroups exchange dS through shared memory).
// Every 16-bit tile is stored as 64-column panels of 128-byte rows in the hardware's 128-byte
// swizzle (a bias row broadcast over queries, plain).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/kernel_params.h"
#include "cuda/sm90/fwd_params.h"
#include "cuda/sm90/sync.cuh"

namespace dmattn::cuda::sm90 {

struct BwdParamsSm90 {
  BwdParams p;
  int64_t kv_entry_elems;  // elements of k (or v) per distinct batch entry: Lk * Hk * D
  CUtensorMap q_tma;
  CUtensorMap do_tma;
  CUtensorMap k_tma;
  CUtensorMap v_tma;
  CUtensorMap lse_tma;   // lse and D as flat vectors (EncodeVectorMap)
  CUtensorMap dsum_tma;
  CUtensorMap mask_tma;  // the mask's bits (as the forward's)
  OperandTiles mask_tiles;
  CUtensorMap bias_tma;   // the bias (as the forward's), loaded into the block's dS slot
  CUtensorMap dbias_tma;  // a full-size dbias, stored from the dS slot
  OperandTiles bias_tiles, dbias_tiles;
  // Deterministic calls: the (kv head, class) slots whose CTAs interleave (deterministic_cta).
  int chain_slots;
};

// A query block as the scheduler warp hands it to the other roles through a queue in shared
// memory (bwd_scheduler.cuh), in parts that lead one another: each role pops the part it reads.
struct QueuedRows {  // the consumers'
  int m0;            // its first query row; -1: the walk is over
  detail::SeqLens lens;
  uint16_t row_shift;  // of its first lse / D row in their slots
  uint16_t flags;      // kBlockMasked | kBlockWaits | kBlockIndexed
};
struct QueuedBlock : QueuedRows {  // the loader's and the dQ warps'
  int b, h;                         // its (batch, query head)
  int lse_box;  // the first row of its lse / D box (a TMA coordinate: the 16-byte boundary below)
};
constexpr int kBlockMasked = 1;  // its mask bits come with its Q (a tile partly hidden)
constexpr int kBlockWaits = 2;   // deterministic: the next key block adds to its dQ first
// Its tile holds more than one segment id: the loader writes the bits of the pairs that share
// one as the block's mask bits (with kBlockMasked; calls with segment ids have no mask: Takes).
constexpr int kBlockIndexed = 4;

// Named barriers (0 is __syncthreads'): both consumers' dS of a block stored; the consumers'
// epilogue; per dQ stage, the stage free / written (the consumers and the stage's dQ warp).
constexpr int kBwdDsReadyBarrier = 1;
constexpr int kBwdEpilogueBarrier = 2;
constexpr int kBwdDqEmptyBarrier = 3;  // + stage
constexpr int kBwdDqFullBarrier = 5;   // + stage
constexpr int kConsumerThreads = 256;
constexpr int kDqHandoffThreads = kConsumerThreads + 32;

// kDqStages_: dQ stages, each reduced by a dQ warp of its own (warps 1, 2), the blocks taking
// them in turn. Deterministic calls take two, so that their turns (round trips through L2)
// overlap; the others one (a second stage made them 1-2 % slower on an H100). kBias_: the call
// has a bias (without, none of its code takes registers from the consumers). kSegments_: it has
// segment ids, applied as mask bits (kBlockIndexed; a kernel of its own: their walk and bits in
// every kernel moved the others' register allocation, the biased consumers into spills). kGate_:
// gated calls (gate.cuh), without a mask, bias or segment ids: each block's alpha rows and the
// key block's delta (of the block's batch entry) come with its Q into a slot of their own.
// kForms_: block indices alone whose blocks are whole tiles (BlockIndicesHoldTiles), without a
// mask, bias, segment ids or the gate: the scheduler's walk skips the query blocks no listed
// block meets, and every block it queues is whole.
template <int D_, int kDqStages_ = 1, bool kBias_ = false, bool kSegments_ = false,
          bool kGate_ = false, bool kForms_ = false>
struct BwdTraitsSm90 {
  static constexpr int D = D_, BN = 128, BM = 64, kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = 2;  // Q / dO ring slots
  static constexpr int kDqStages = kDqStages_;
  static constexpr bool kSegments = kSegments_;
  static constexpr bool kBias = kBias_;
  static constexpr bool kGate = kGate_;
  static constexpr bool kForms = kForms_;
  // 56 + 2 x 224 registers of the launch's 3 x 168: the producer warpgroup's scheduler and
  // loader spilled at 24 (local traffic beside the consumers' shared memory: D64 backward 6 %
  // slower at 24, 4 % at 40 than at 56 on an H100), and the consumers fit 224 (at D128 with a
  // few spills, D64 none; with a bias too, which initialises S^T rather than being added to it).
  static constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  static_assert(kProducerRegs + kConsumers * kConsumerRegs <= (kConsumers + 1) * 168,
                "register budgets within the CTA's launch allocation");

  static constexpr int kPanels = D / 64;  // 64-column panels of a Q / K tile
  static constexpr int kKeys = BN / kConsumers;   // a warpgroup's keys (wgmma M of S^T, dK, dV)
  static constexpr int kDqCols = D / kConsumers;  // a warpgroup's dQ columns (wgmma N)
  static_assert(D == 64 || D == 128, "dK + dV of 64 keys take D registers a thread");
  static_assert(kKeys == 64 && BM == 64, "one wgmma M of keys, one N of queries");
  static_assert(BM == kDqTurnRows, "a dQ turn flag per query block");

  static constexpr uint32_t kKVBytes = BN * D * 2;
  static constexpr uint32_t kQBytes = BM * D * 2;
  // dS: [query][key], two 64-column panels; a block's bias tile (its TMA box, the same layout)
  // waits in its dS slot until P is computed.
  static constexpr uint32_t kDsBytes = BN * BM * 2;
  static constexpr uint32_t kDqBytes = BM * D * 4;   // fp32, StagedDq's layout
  static constexpr uint32_t kOffK = 0;
  static constexpr uint32_t kOffV = kOffK + kKVBytes;
  static constexpr uint32_t kOffQ = kOffV + kKVBytes;        // kStages slots
  static constexpr uint32_t kOffdO = kOffQ + kStages * kQBytes;
  // dS slots, taken by the blocks in turn: one warpgroup may store the next block's dS while the
  // other's dQ GEMM still reads this one's (each waits for its own dQ GEMM before the next
  // block's barrier, so two suffice). With a bias, three: a slot holds its block's bias tile
  // from the load and its dS until the dQ warp has stored it into dbias, and the next bias
  // loads must not wait for that store (ds_empty).
  static constexpr int kDsSlots = kBias ? 3 : 2;
  static constexpr uint32_t kOffdS = kOffdO + kStages * kQBytes;
  static constexpr uint32_t kOffDq = kOffdS + kDsSlots * kDsBytes;
  // A block's lse / D rows: TMA boxes of kRowBox floats from the 16-byte boundary at or below
  // the first row (a box must start on one), in slots of kRowSlot floats.
  static constexpr int kRowBox = BM + 4, kRowSlot = 96;
  static constexpr uint32_t kOffLse = kOffDq + kDqStages * kDqBytes;  // kStages slots
  static constexpr uint32_t kOffDsum = kOffLse + kStages * kRowSlot * 4;
  // A block's mask bits (BM rows of BN / 8 bytes) beside its Q, one per ring slot. Deterministic
  // calls (two dQ stages) have no room for them at D = 128: with a mask they run the
  // FlashAttention-2-class backward (Takes), as gated calls with a mask do.
  static constexpr bool kMasks = kDqStages == 1 && !kGate;
  static_assert(!kSegments || (kMasks && !kBias), "segment ids as mask bits, without a bias");
  static_assert(!kBias || kDqStages == 1, "a bias beside one dQ stage (Takes)");
  static_assert(!kGate || (kDqStages == 1 && !kBias && !kSegments),
                "gated kernels: one dQ stage, no bias or segment ids (Takes)");
  static_assert(!kGate || (kGateBlockQ % BM == 0 && kGateBlockK % BN == 0),
                "tiles nest in the gate threshold's grid");
  static_assert(!kForms || (kDqStages == 1 && !kBias && !kSegments && !kGate),
                "block-index kernels: one dQ stage, no bias, segment ids or gate (Takes)");
  static constexpr uint32_t kMaskBytes = BM * BN / 8;
  static constexpr uint32_t kOffMask = kOffDsum + kStages * kRowSlot * 4;
  // Queued blocks: the dQ warps' lag, the ring's two and the scheduler's lead.
  static constexpr int kQueueSlots = 8;
  // A bias broadcast over queries: its row of keys per ring slot (one unswizzled box of BN keys,
  // read by every query row of the block).
  static constexpr uint32_t kBiasRowBytes = BN * 2;
  static constexpr uint32_t kOffBiasRow = kOffMask + (kMasks ? kStages * kMaskBytes : 0);
  // The gate's alpha of the block's BM rows, then delta of the BN keys, per ring slot (zeros past
  // the ends): the loader's lanes copy them (a one-float column is under TMA's 16-byte box).
  static constexpr uint32_t kGateBytes = kGate ? (BM + BN) * 4 : 0;
  static constexpr uint32_t kOffGate = kOffBiasRow + (kBias ? kStages * kBiasRowBytes : 0);
  static constexpr uint32_t kOffQueue = kOffGate + kStages * kGateBytes;
  static constexpr uint32_t kOffBarriers = kOffQueue + kQueueSlots * sizeof(QueuedBlock);
  // kv_full, then q_full, q_empty, do_full, do_empty per slot, the queue's full, empty, then
  // ds_empty per dS slot
  static constexpr int kBarriers = 1 + 4 * kStages + 2 * kQueueSlots + kDsSlots;
  static constexpr uint32_t kSmem = kOffBarriers + kBarriers * 8;
  static_assert(kKVBytes % 1024 == 0 && kQBytes % 1024 == 0 && kDsBytes % 1024 == 0,
                "tiles on 1024-byte boundaries (the swizzle is a function of the address)");
  static_assert(kSmem <= 227 * 1024, "shared memory of one Hopper CTA");
  static_assert(kDqStages <= kBwdDqFullBarrier - kBwdDqEmptyBarrier && kDqStages <= 2,
                "a named barrier pair per dQ stage; the loader and scheduler warps beside the "
                "dQ warps");
  static_assert(kRowBox <= kRowSlot && kOffLse % 128 == 0 && (kRowSlot * 4) % 128 == 0,
                "TMA destinations of the rows");
  static_assert(kOffMask % 128 == 0 && kMaskBytes % 128 == 0 && kBiasRowBytes % 128 == 0,
                "TMA destinations of the masks and bias rows");
  static_assert(kGateBytes % 16 == 0, "the gate slots keep the queue 16-byte aligned");
  static_assert((kQueueSlots * sizeof(QueuedBlock)) % 8 == 0 && sizeof(QueuedRows) == 16,
                "the queue keeps the barriers 8-byte aligned; the consumers' part, one load");

  // Every consumer warp releases a ring slot once its wgmmas have read it; a queue slot, every
  // thread of the consumers, the dQ warps and the loader warp once it has read the block.
  static constexpr int kReleaseArrivals = 4 * kConsumers;
  // The segment kernel's loader lanes write its mask bits with plain stores: each lane that
  // writes them arrives on q_full, and every consumer thread that reads them on q_empty (one
  // arrival for its warp orders no other lane's access: racecheck saw hazards both ways). The
  // gated kernel's lanes arrive once their copies of the gate have landed, beside the TMA's.
  static constexpr int kQFullArrivals = kSegments ? 32 : kGate ? 1 + 32 : 1;
  static constexpr int kQEmptyArrivals =
      kSegments || kGate ? kConsumerThreads : kReleaseArrivals;
  static constexpr int kQueueArrivals = 32 * (4 * kConsumers + kDqStages + 1);
};

template <typename Tr>
struct BwdBarriers {
  uint64_t* base;
  __device__ __forceinline__ uint64_t* kv_full() const { return base; }
  __device__ __forceinline__ uint64_t* q_full(int slot) const { return base + 1 + slot; }
  __device__ __forceinline__ uint64_t* q_empty(int slot) const {
    return base + 1 + Tr::kStages + slot;
  }
  __device__ __forceinline__ uint64_t* do_full(int slot) const {
    return base + 1 + 2 * Tr::kStages + slot;
  }
  __device__ __forceinline__ uint64_t* do_empty(int slot) const {
    return base + 1 + 3 * Tr::kStages + slot;
  }
  __device__ __forceinline__ uint64_t* queue_full() const { return base + 1 + 4 * Tr::kStages; }
  __device__ __forceinline__ uint64_t* queue_empty() const {
    return queue_full() + Tr::kQueueSlots;
  }
  __device__ __forceinline__ uint64_t* ds_empty(int slot) const {
    return queue_empty() + Tr::kQueueSlots + slot;
  }
};

}  // namespace dmattn::cuda::sm90
