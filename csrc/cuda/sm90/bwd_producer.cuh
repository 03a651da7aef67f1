// Producer warpgroup of the Hopper backward. Warp 0 (the loader): K and V of the key block by TMA
// once, then per queued query block Q with its lse rows (and mask bits, or those of its segment
// ids, written by the warp; its bias tile, in its dS slot; the gate's alpha rows and delta of the
// key block, copied by the warp's lanes) and dO with its D rows by TMA into the
// next ring slot, each slot once the consumers have released it (lse and D are read as flat
// vectors: a block's rows start anywhere, its box on the 16-byte boundary below; the consumers mask
// the rows past its length). Warp 1 (warps 1 and 2 in turn, deterministic): each block's dQ stage,
// once both consumers have written it, added to the fp32 accumulator with one bulk reduction (in
// turn with the other key blocks in a deterministic call), then handed back; with a full-size
// dbias, the block's dS tile stored into it too, after which the warp releases the dS slot with the
// consumers. Warp 3 walks the blocks and queues them (schedule, bwd_scheduler.cuh).
#pragma once

#include "cuda/sm90/bwd_scheduler.cuh"

namespace dmattn::cuda::sm90 {

// The mask bits of a block whose tile holds more than one segment id (kBlockIndexed), as the
// consumers read a mask's (apply_mask_t; BM rows of BN / 8 bytes): bit k of row r where query
// m0 + r and key n0 + k share an id. Lane l takes rows 2 l, 2 l + 1 and the ids of keys l + 32 j
// (the ids straight from memory; rare blocks in packed batches). Rows and keys past the ends
// read the last id; the consumers' bounds test hides them. Warp-wide.
template <typename Tr>
__device__ __forceinline__ void write_segment_bits(const BwdParams& p, const QueuedBlock& blk,
                                                   int n0, uint8_t* tile) {
  static_assert(Tr::BM == 64 && Tr::BN == 128, "two rows a lane, a row of four 32-bit words");
  const int lane = threadIdx.x & 31;
  const int32_t* q_ids = detail::q_segment_row(p, blk.b);
  const int32_t* kv_ids = detail::kv_segment_row(p, blk.b);
  const int last_q = static_cast<int>(p.s.seqlen_q) - 1;
  const int last_k = static_cast<int>(p.s.seqlen_k) - 1;
  int row_id[2], key_id[4];
#pragma unroll
  for (int r = 0; r < 2; ++r) row_id[r] = __ldg(q_ids + min(blk.m0 + 2 * lane + r, last_q));
#pragma unroll
  for (int j = 0; j < 4; ++j) key_id[j] = __ldg(kv_ids + min(n0 + 32 * j + lane, last_k));
  uint32_t words[2][4] = {};
#pragma unroll 1
  for (int k = 0; k < 32; ++k) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int id = __shfl_sync(0xffffffffu, key_id[j], k);
#pragma unroll
      for (int r = 0; r < 2; ++r) words[r][j] |= uint32_t{id == row_id[r]} << k;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    *reinterpret_cast<uint4*>(tile + (2 * lane + r) * (Tr::BN / 8)) =
        make_uint4(words[r][0], words[r][1], words[r][2], words[r][3]);
  }
}

// The gate's alpha of the block's rows and delta of the CTA's keys (of the block's batch entry)
// into ring slot `slot` by the loader's lanes, each arriving on the slot's q_full once its copies
// have landed (kQFullArrivals). Zeros past the last row or key: the consumers hide those pairs.
template <typename Tr>
__device__ __forceinline__ void load_gate(const BwdParams& p, uint8_t* smem, uint64_t* full,
                                          int slot, const QueuedBlock& blk, int n0) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const detail::GateView gate(p, blk.b, blk.h);
  float* dst = reinterpret_cast<float*>(smem + Tr::kOffGate + slot * Tr::kGateBytes);
  gate.load_rows_async<Tr::BM, 32>(dst, blk.m0, static_cast<int>(p.s.seqlen_q) - blk.m0, lane);
  gate.load_keys_async<Tr::BN, 32>(dst + Tr::BM, n0, static_cast<int>(p.s.seqlen_k) - n0, lane);
  mbar_arrive_on_cp_async(full);
}

template <typename Tr>
__device__ __forceinline__ void load(const BwdParamsSm90& P, uint8_t* smem,
                                     const BwdBarriers<Tr>& bar, const BlockQueue<Tr>& queue,
                                     const BwdCtaWork& w) {
  constexpr int BM = Tr::BM, BN = Tr::BN;
  const BwdParams& p = P.p;
  const AttentionShape& s = p.s;
  const bool leader = (threadIdx.x & 31) == 0;
  const int64_t b_rep = detail::batch_of(p, w.cta.cls, 0);
  const int kv_entry = static_cast<int>(s.kv_offset(b_rep, 0) / P.kv_entry_elems);
  if (leader) {
    tma_prefetch_descriptor(&P.q_tma);
    tma_prefetch_descriptor(&P.do_tma);
    tma_prefetch_descriptor(&P.lse_tma);
    tma_prefetch_descriptor(&P.dsum_tma);
    if (p.mask != nullptr) tma_prefetch_descriptor(&P.mask_tma);
    if (Tr::kBias) tma_prefetch_descriptor(&P.bias_tma);
    mbar_arrive_expect_tx(bar.kv_full(), 2 * Tr::kKVBytes);
#pragma unroll
    for (int panel = 0; panel < Tr::kPanels; ++panel) {
      tma_load(smem + Tr::kOffK + panel * BN * 128, &P.k_tma, bar.kv_full(), panel * 64,
               w.cta.hk, w.n0, kv_entry);
      tma_load(smem + Tr::kOffV + panel * BN * 128, &P.v_tma, bar.kv_full(), panel * 64,
               w.cta.hk, w.n0, kv_entry);
    }
  }
  float* lse_slots = reinterpret_cast<float*>(smem + Tr::kOffLse);
  float* dsum_slots = reinterpret_cast<float*>(smem + Tr::kOffDsum);
  const uint32_t mask_rows = P.mask_tiles.one_row ? 1 : BM;
  const uint32_t bias_bytes = Tr::kBias ? (P.bias_tiles.one_row ? 1 : BM) * BN * 2 : 0;

  // The block's bias tile into dS slot `ds_slot` (64-column panels), or its row of keys into
  // ring slot `slot`'s bias row when the bias is broadcast over queries, completing `full`.
  auto load_bias = [&](int slot, int ds_slot, uint64_t* full, const QueuedBlock& blk) {
    const int hc = P.bias_tiles.head_coord(s.bias, blk.h);
    const int bc = P.bias_tiles.batch_coord(s.bias, s.batch, blk.b);
    if (P.bias_tiles.one_row) {
      tma_load(smem + Tr::kOffBiasRow + slot * Tr::kBiasRowBytes, &P.bias_tma, full, w.n0, 0, hc,
               bc);
      return;
    }
    uint8_t* dst = smem + Tr::kOffdS + ds_slot * Tr::kDsBytes;
#pragma unroll
    for (int panel = 0; panel < BN / 64; ++panel) {
      tma_load(dst + panel * BM * 128, &P.bias_tma, full, w.n0 + panel * 64, blk.m0, hc, bc);
    }
  };

  // A Q or dO tile of the block at `offset` and its rows of a per-row vector (lse or D) at
  // `rows`, completing `full` (with `extra_bytes` more that the caller loads).
  auto load_rows = [&](uint32_t offset, const CUtensorMap* map, float* rows,
                       const CUtensorMap* row_map, uint64_t* full, const QueuedBlock& blk,
                       uint32_t extra_bytes) {
    if (!leader) return;
    mbar_arrive_expect_tx(full, Tr::kQBytes + Tr::kRowBox * 4 + extra_bytes);
#pragma unroll
    for (int panel = 0; panel < Tr::kPanels; ++panel) {
      tma_load(smem + offset + panel * BM * 128, map, full, panel * 64, blk.h, blk.m0,
               blk.b);
    }
    tma_load(rows, row_map, full, blk.lse_box, 0, 0, 0);
  };
  RingPos<Tr::kStages> ring;
  RingPos<Tr::kDsSlots> ds_ring;
  for_each_queued_block<Tr, QueuedBlock>(queue, [&](const QueuedBlock& blk) {
    const int slot = ring.slot;
    const bool indexed = Tr::kSegments && (blk.flags & kBlockIndexed);
    const uint32_t mask_bytes =
        (blk.flags & kBlockMasked) && !indexed ? mask_rows * (BN / 8) : 0;
    if (Tr::kBias) mbar_wait(bar.ds_empty(ds_ring.slot), ds_ring.parity ^ 1);
    mbar_wait(bar.q_empty(slot), ring.parity ^ 1);
    uint8_t* mask_slot = smem + Tr::kOffMask + slot * Tr::kMaskBytes;
    if (indexed) write_segment_bits<Tr>(p, blk, w.n0, mask_slot);
    load_rows(Tr::kOffQ + slot * Tr::kQBytes, &P.q_tma, lse_slots + slot * Tr::kRowSlot,
              &P.lse_tma, bar.q_full(slot), blk, mask_bytes + bias_bytes);
    if (Tr::kSegments && !leader) mbar_arrive(bar.q_full(slot));  // each lane: kQFullArrivals
    if constexpr (Tr::kGate) load_gate<Tr>(p, smem, bar.q_full(slot), slot, blk, w.n0);
    if (leader && Tr::kBias) load_bias(slot, ds_ring.slot, bar.q_full(slot), blk);
    ds_ring.advance();
    if (leader && mask_bytes > 0) {  // the block's mask bits, with Q
      tma_load(mask_slot, &P.mask_tma, bar.q_full(slot), w.n0 / 8,
               P.mask_tiles.one_row ? 0 : blk.m0, P.mask_tiles.head_coord(s.mask, blk.h),
               P.mask_tiles.batch_coord(s.mask, s.batch, blk.b));
    }
    mbar_wait(bar.do_empty(slot), ring.parity ^ 1);
    load_rows(Tr::kOffdO + slot * Tr::kQBytes, &P.do_tma, dsum_slots + slot * Tr::kRowSlot,
              &P.dsum_tma, bar.do_full(slot), blk, 0);
    ring.advance();
  });
}

// The block's dS tile (tile: its dS slot) into a full-size dbias, two 64-column boxes.
template <typename Tr>
__device__ __forceinline__ void store_dbias(const BwdParamsSm90& P, const uint8_t* tile,
                                            const QueuedBlock& blk, const BwdCtaWork& w) {
  const AttentionShape& s = P.p.s;
  const int hc = P.dbias_tiles.head_coord(P.p.dbias_op, blk.h);
  const int bc = P.dbias_tiles.batch_coord(P.p.dbias_op, s.batch, blk.b);
#pragma unroll
  for (int panel = 0; panel < Tr::BN / 64; ++panel) {
    tma_store(&P.dbias_tma, tile + panel * Tr::BM * 128, w.n0 + panel * 64, blk.m0, hc, bc);
  }
}

// A dQ warp: one bulk reduction per query block from its stage, which the consumers fill with
// every kDqStages-th block's dQ (from the `stage`-th). In a deterministic call it first waits for
// the next key block's reduction into the same rows, and passes the turn on once its own has
// landed (after handing the stage back).
template <typename Tr>
__device__ __forceinline__ void reduce_dq(const BwdParamsSm90& P, const uint8_t* smem,
                                          const BwdBarriers<Tr>& bar, const BlockQueue<Tr>& queue,
                                          const BwdCtaWork& w, int stage) {
  const BwdParams& p = P.p;
  const bool leader = (threadIdx.x & 31) == 0;
  const float* dq = reinterpret_cast<const float*>(smem + Tr::kOffDq + stage * Tr::kDqBytes);
  int32_t* landed = nullptr;  // the flag of the last reduction, until its turn is passed on
  const int32_t added = w.cta.n_block + 1;  // a flag's value once this key block has added
  // A full-size dbias is the block's dS tile as the consumers stored it (one dQ stage: this warp
  // sees every block); its dS slot waits for this warp too, the dQ stage does not.
  const bool stores_dbias = Tr::kBias && p.dbias_mode == kDbiasDirect;
  RingPos<Tr::kDsSlots> ring;
  int stored_slot = -1;  // the dS slot of the last dbias store, until its read has completed
  auto release_stored_slot = [&] {
    if (leader && stored_slot >= 0) {
      detail::bulk_wait_read();
      mbar_arrive(bar.ds_empty(stored_slot));
    }
    stored_slot = -1;
  };
  QueueReader<Tr, QueuedBlock> blocks{queue};
  int skip = stage;  // the other stages' blocks before this stage's next
  auto next_block = [&] {
    QueuedBlock blk = blocks.next();
    for (; skip > 0 && blk.m0 >= 0; --skip) blk = blocks.next();
    skip = Tr::kDqStages - 1;
    return blk;
  };
  QueuedBlock blk = next_block();
#pragma unroll 1
  while (blk.m0 >= 0) {
    named_arrive(kBwdDqEmptyBarrier + stage, kDqHandoffThreads);
    release_stored_slot();
    if (leader && landed != nullptr) pass_turn(landed, added);
    // the next block while the consumers fill the stage: nothing but the reduction between the
    // stage written and the stage handed back
    const QueuedBlock next = next_block();
    named_sync(kBwdDqFullBarrier + stage, kDqHandoffThreads);
    if (leader) {
      if (p.dq_turns != nullptr) {
        landed = turn_flag<Tr>(p, blk);
        if (blk.flags & kBlockWaits) wait_turn(landed, added + 1);
      }
      float* dst = p.dq_accum + (StagedDq::row(p.s, blk.b, blk.h) + blk.m0) * Tr::D;
      const int rows = min(Tr::BM, blk.lens.q_len - blk.m0);
      detail::bulk_reduce_add(dst, dq, rows * Tr::D * 4);
      detail::bulk_commit();
      if (stores_dbias) {
        store_dbias<Tr>(P, smem + Tr::kOffdS + ring.slot * Tr::kDsBytes, blk, w);
        detail::bulk_commit();
        detail::bulk_wait_read<1>();  // the dQ stage read: handed back before the dbias store
      } else {
        detail::bulk_wait_read();
      }
    }
    if (stores_dbias) stored_slot = ring.slot;
    __syncwarp();
    ring.advance();
    blk = next;
  }
  release_stored_slot();
  if (leader && landed != nullptr) pass_turn(landed, added);
}

}  // namespace dmattn::cuda::sm90
