// sm_90a synchronisation and copy primitives of the warp-specialised kernels: mbarriers (the
// producer / consumer ring), the tensor memory accelerator (TMA: whole tiles between global and
// shared memory, completing on an mbarrier), named barriers among warpgroups, turns between CTAs
// (flags in global memory), register reallocation between warpgroups (setmaxnreg) and a queue of
// small items from a producer thread to other warps.
//
// An mbarrier here counts a phase: it completes when its expected arrivals have arrived and the
// bytes announced with arrive_expect_tx have landed; waiters name the parity of the phase they
// wait for. A ring slot's "full" barrier is completed by the producer's TMA, its "empty" barrier
// by the consumers that have finished reading it.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda/kernel_utils.cuh"
#include "cuda/sm90.cuh"

#if defined(DMATTN_WGMMA)
#define DMATTN_SM90A_ONLY(...) __VA_ARGS__
#else
#define DMATTN_SM90A_ONLY(...)
#endif

namespace dmattn::cuda::sm90 {

using detail::smem_u32;

__device__ __forceinline__ void mbar_init(uint64_t* bar, int arrivals) {
  DMATTN_SM90A_ONLY(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)),
                                 "r"(arrivals)
                                 : "memory");)
}
// Makes the initialised barriers visible to the async proxy (TMA) and the other threads, with
// the CTA barrier that follows.
__device__ __forceinline__ void mbar_init_fence() {
  DMATTN_SM90A_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");)
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  DMATTN_SM90A_ONLY(asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar))
                                 : "memory");)
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar, uint32_t count) {
  DMATTN_SM90A_ONLY(asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                                     smem_u32(bar)),
                                 "r"(count)
                                 : "memory");)
}
// One arrival that also announces `bytes` of TMA traffic for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  DMATTN_SM90A_ONLY(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                                     smem_u32(bar)),
                                 "r"(bytes)
                                 : "memory");)
}
// One arrival once every cp.async this thread issued before has landed (not counted in the
// barrier's pending arrivals: its init count includes it).
__device__ __forceinline__ void mbar_arrive_on_cp_async(uint64_t* bar) {
  DMATTN_SM90A_ONLY(asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                                     smem_u32(bar))
                                 : "memory");)
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts the phase of
// parity 1 as completed, so producers start waiting on their empty barriers with parity 1).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  DMATTN_SM90A_ONLY(uint32_t done = 0; const uint32_t addr = smem_u32(bar); do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);)
}

// A 4-d box of the tensor that `map` describes (coordinates innermost first) into shared
// memory, completing `bytes` of `bar`'s transaction count; out-of-bounds elements read as 0.
__device__ __forceinline__ void tma_load(void* dst, const void* map, uint64_t* bar, int c0, int c1,
                                         int c2, int c3) {
  DMATTN_SM90A_ONLY(asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");)
}
// A box of shared memory to the tensor `map` describes; elements out of bounds are not written.
// Completes as a bulk group (detail::bulk_commit / bulk_wait_read).
__device__ __forceinline__ void tma_store(const void* map, const void* src, int c0, int c1, int c2,
                                          int c3) {
  DMATTN_SM90A_ONLY(asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");)
}
__device__ __forceinline__ void tma_prefetch_descriptor(const void* map) {
  DMATTN_SM90A_ONLY(
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");)
}

// Named barriers (id 0 is __syncthreads'): `threads` (a multiple of 32) take part; sync waits,
// arrive does not.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Whether `pred` holds for any of the `threads` threads meeting at named barrier `id` (a
// barrier of theirs, like named_sync).
__device__ __forceinline__ bool named_any(int id, int threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  // From lane 0: the compiler then knows the result warp-uniform (wgmma under a branch it cannot
  // prove uniform is serialised).
  return __shfl_sync(0xffffffffu, any, 0) != 0;
}

// Turns between CTAs through a flag in global memory, taken by one thread each. wait_turn returns
// once the flag holds `value`; the caller's bulk operations after it see the memory the passing
// CTA's bulk operations wrote before it. pass_turn waits for the caller's bulk operations to
// complete (not only to have read their source) and then sets the flag.
__device__ __forceinline__ void wait_turn(const int32_t* flag, int32_t value) {
  DMATTN_SM90A_ONLY(int32_t seen; do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
  } while (seen != value);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");)
}
__device__ __forceinline__ void pass_turn(int32_t* flag, int32_t value) {
  DMATTN_SM90A_ONLY(asm volatile(
      "cp.async.bulk.wait_group 0;\nfence.proxy.async.global;\n"
      "st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag),
      "r"(value)
      : "memory");)
}

// Register reallocation: the warpgroup gives registers back (dec) or takes them (inc); every
// warp of the warpgroup executes it. Only effective in a kernel with a register cap at entry.
template <int kRegs>
__device__ __forceinline__ void release_registers() {
  DMATTN_SM90A_ONLY(asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));)
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
  DMATTN_SM90A_ONLY(asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));)
}

// A ring position: slot index and the parity of the slot's current phase.
template <int kSlots>
struct RingPos {
  int slot = 0;
  uint32_t parity = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kSlots) {
      slot = 0;
      parity ^= 1;
    }
  }
};

// Items from one producer thread to several warps through shared memory: slot i holds an item
// once full[i] completes; every reader releases it through empty[i], whose count says who reads:
// one lane per popping warp (pop) or every thread that pops (pop_each).
template <typename Item, int kSlots>
struct SmemQueue {
  static_assert(sizeof(Item) % 4 == 0, "items pass between lanes as 32-bit words");
  Item* items;      // [kSlots]
  uint64_t* full;   // [kSlots], one arrival (the producer)
  uint64_t* empty;  // [kSlots], one arrival per reader

  __device__ __forceinline__ void push(RingPos<kSlots>& pos, const Item& item) const {
    mbar_wait(empty + pos.slot, pos.parity ^ 1);
    items[pos.slot] = item;
    mbar_arrive(full + pos.slot);
    pos.advance();
  }
  // The next item, read by each warp's lane 0 and passed to its lanes: an arrival releases only
  // its own thread's reads, so the lane that reads is the lane that arrives.
  __device__ __forceinline__ Item pop(RingPos<kSlots>& pos, int lane) const {
    constexpr int kWords = sizeof(Item) / 4;
    mbar_wait(full + pos.slot, pos.parity);
    uint32_t words[kWords] = {};
    if (lane == 0) {
      const uint32_t* slot = reinterpret_cast<const uint32_t*>(items + pos.slot);
#pragma unroll
      for (int i = 0; i < kWords; ++i) words[i] = slot[i];
      mbar_arrive(empty + pos.slot);
    }
    pos.advance();
#pragma unroll
    for (int i = 0; i < kWords; ++i) words[i] = __shfl_sync(0xffffffffu, words[i], 0);
    Item item;
    memcpy(&item, words, sizeof(item));
    return item;
  }
  // The next item's part `Part` (a base of Item), read and released by every calling thread:
  // no shuffles between the read and its use.
  template <typename Part = Item>
  __device__ __forceinline__ Part pop_each(RingPos<kSlots>& pos) const {
    mbar_wait(full + pos.slot, pos.parity);
    const Part part = items[pos.slot];
    mbar_arrive(empty + pos.slot);
    pos.advance();
    return part;
  }
};

}  // namespace dmattn::cuda::sm90

#undef DMATTN_SM90A_ONLY
