// sm_90a instructions: warpgroup MMA (wgmma.mma_async) and bulk reductions to global memory.
//
// wgmma: one warpgroup (4 warps) computes a 64 x N tile, the operands read by the tensor cores
// straight from shared memory (no ldmatrix), A optionally from registers. The accumulator of
// warp w of the warpgroup holds rows 16 w .. 16 w + 15 in exactly the layout of mma.sync m16n8
// accumulators laid side by side (d[4 j + e] is 8-column tile j, element e), and a register A
// fragment is mma.sync m16n8k16's A fragment, so the kernels' softmax, masking and P packing
// code is the same for both instruction sets.
//
// Shared-memory operands are SwizzledTile panels: rows of 64 16-bit elements (128 bytes) whose
// 16-byte chunks are XOR-ed with row % 8, i.e. the hardware's 128-byte swizzle. The tiles start
// on 1024-byte boundaries (the swizzle is a function of the absolute address).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kernel_utils.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DMATTN_WGMMA 1
#endif

namespace dmattn::cuda {
#if defined(DMATTN_WGMMA)
constexpr bool kSm90aPass = true;  // this device pass compiles sm_90a code
#else
constexpr bool kSm90aPass = false;
#endif
}  // namespace dmattn::cuda

namespace dmattn::cuda::detail {

// Descriptor of a 128-byte-swizzled SwizzledTile operand starting at `addr` (its 8-row groups
// are 1024 bytes apart). K-major (contiguous along the reduction dim): `panel_bytes` is unused.
// MN-major (contiguous along M / N): 64-element panels along M / N are `panel_bytes` apart.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t panel_bytes) {
  constexpr uint64_t kSwizzle128 = 1ull << 62;
  constexpr uint64_t kGroupBytes = 1024;
  return kSwizzle128 | ((kGroupBytes >> 4) << 32) |
         (static_cast<uint64_t>((panel_bytes >> 4) & 0x3fff) << 16) | ((addr >> 4) & 0x3fff);
}
// The descriptor of the same layout `bytes` further on (bytes a multiple of 16).
__device__ __forceinline__ uint64_t gmma_advance(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// The wrappers are declared for every target so that kernels can name them in branches that
// are discarded (if constexpr) when not compiling for sm_90a; there the asm is left out.
#if defined(DMATTN_WGMMA)
#define DMATTN_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define DMATTN_SM90A_ASM(...) \
  do {                        \
  } while (0)
#endif

__device__ __forceinline__ void wgmma_fence() {
  DMATTN_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  DMATTN_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  DMATTN_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared-memory writes of the generic proxy (st.shared, cp.async) become visible to wgmma (the
// async proxy) after this fence and a barrier.
__device__ __forceinline__ void fence_async_shared() {
  DMATTN_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins accumulator registers at this point of the program: reads after a wgmma_wait may not
// move above it, writes before a wgmma may not move below.
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define DMATTN_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define DMATTN_F16(d, i) DMATTN_F4(d, i), DMATTN_F4(d, i + 4), DMATTN_F4(d, i + 8), DMATTN_F4(d, i + 12)
#define DMATTN_F16_(d) DMATTN_F16(d, 0)
#define DMATTN_F32(d) DMATTN_F16(d, 0), DMATTN_F16(d, 16)
#define DMATTN_F64(d) DMATTN_F32(d), DMATTN_F16(d, 32), DMATTN_F16(d, 48)
#define DMATTN_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define DMATTN_R32                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define DMATTN_R64                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D (64 x N, fp32) = A (64 x 16) B (16 x N) + (accumulate ? D : 0). SS: both operands in shared
// memory (descriptors); RS: A from registers. kTA / kTB: the operand is MN-major (transposed;
// 16-bit types only). The element type is a tag argument. Operands after the R accumulators:
// SS  %R a, %R+1 b, %R+2 accumulate, %R+3 kTA, %R+4 kTB;
// RS  %R..%R+3 a, %R+4 b, %R+5 accumulate, %R+6 kTB.
#define DMATTN_WGMMA_N(R, OPS, CT, SS_TAIL, RS_TAIL)                                         \
  template <int kTA, int kTB>                                                                 \
  __device__ __forceinline__ void wgmma_ss(float (&d)[R], uint64_t a, uint64_t b,             \
                                           bool accumulate, CT) {                             \
    DMATTN_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" SS_TAIL ";\n}\n"                  \
                     : OPS(d)                                                                 \
                     : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(kTA), "n"(kTB)); \
  }                                                                                           \
  template <int kTB>                                                                          \
  __device__ __forceinline__ void wgmma_rs(float (&d)[R], const uint32_t (&a)[4], uint64_t b, \
                                           bool accumulate, CT) {                             \
    DMATTN_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" RS_TAIL ";\n}\n"                  \
                     : OPS(d)                                                                 \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b),                    \
                       "r"(static_cast<int>(accumulate)), "n"(kTB));                          \
  }
#define DMATTN_SS_TAIL(N, TY, REGS, R, R1, R2, R3, R4)                                       \
  #R2 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", %" #R \
      ", %" #R1 ", p, 1, 1, %" #R3 ", %" #R4
#define DMATTN_RS_TAIL(N, TY, REGS, R, R1, R2, R3, R4, R5, R6)                                \
  #R5 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", {%" #R \
      ", %" #R1 ", %" #R2 ", %" #R3 "}, %" #R4 ", p, 1, 1, %" #R6
#define DMATTN_WGMMA_TYPE(TY, CT)                                                              \
  DMATTN_WGMMA_N(16, DMATTN_F16_, CT,                                                         \
                 DMATTN_SS_TAIL(32, TY, DMATTN_R16, 16, 17, 18, 19, 20),                      \
                 DMATTN_RS_TAIL(32, TY, DMATTN_R16, 16, 17, 18, 19, 20, 21, 22))              \
  DMATTN_WGMMA_N(32, DMATTN_F32, CT,                                                          \
                 DMATTN_SS_TAIL(64, TY, DMATTN_R32, 32, 33, 34, 35, 36),                      \
                 DMATTN_RS_TAIL(64, TY, DMATTN_R32, 32, 33, 34, 35, 36, 37, 38))              \
  DMATTN_WGMMA_N(64, DMATTN_F64, CT,                                                          \
                 DMATTN_SS_TAIL(128, TY, DMATTN_R64, 64, 65, 66, 67, 68),                     \
                 DMATTN_RS_TAIL(128, TY, DMATTN_R64, 64, 65, 66, 67, 68, 69, 70))
DMATTN_WGMMA_TYPE("bf16", __nv_bfloat16)
DMATTN_WGMMA_TYPE("f16", __half)

#undef DMATTN_WGMMA_TYPE
#undef DMATTN_SS_TAIL
#undef DMATTN_RS_TAIL
#undef DMATTN_WGMMA_N
#undef DMATTN_R16
#undef DMATTN_R32
#undef DMATTN_R64
#undef DMATTN_F4
#undef DMATTN_F16
#undef DMATTN_F16_
#undef DMATTN_F32
#undef DMATTN_F64

// global[0, bytes) += shared[0, bytes) in fp32 through the bulk-copy unit (one request per
// row instead of one atomic per 4 elements). Both addresses 16-byte aligned, bytes a multiple
// of 16. The shared source may be rewritten after bulk_wait_read() of the issuing thread.
__device__ __forceinline__ void bulk_reduce_add(float* global, const float* shared, int bytes) {
  DMATTN_SM90A_ASM(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
          global),
      "r"(smem_u32(shared)), "r"(bytes)
      : "memory");
}

// global[0, bytes) = shared[0, bytes) through the bulk-copy unit; the same rules.
template <typename T>
__device__ __forceinline__ void bulk_store(T* global, const T* shared, int bytes) {
  DMATTN_SM90A_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(global),
                   "r"(smem_u32(shared)), "r"(bytes)
                   : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  DMATTN_SM90A_ASM("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most kPending of the issuing thread's latest bulk groups still read their
// shared sources.
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_read() {
  DMATTN_SM90A_ASM("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Byte offset of k-step ks (16 along the reduction dim) in a SwizzledTile operand of `rows`
// rows: K-major (the reduction dim along the rows: 32 bytes within a 64-column panel, then the
// next panel) or MN-major (the reduction dim down the rows: 16 rows of 128 bytes).
__device__ __forceinline__ constexpr uint32_t kmajor_step(int ks, int rows) {
  return static_cast<uint32_t>((ks / 4) * rows * 128 + (ks % 4) * 32);
}
__device__ __forceinline__ constexpr uint32_t mnmajor_step(int ks) {
  return static_cast<uint32_t>(ks * 2048);
}
// Byte offset of column `col` (a multiple of 8) along M / N of an MN-major SwizzledTile operand
// of `rows` rows: its 64-column panel, then its place in the panel's 128-byte rows. An operand of
// 32 columns (wgmma N = 32) may start half way into a panel: the hardware swizzles the address it
// forms from the descriptor's start, as it does for kmajor_step's 32-byte steps.
__device__ __forceinline__ constexpr uint32_t mnmajor_col(int col, int rows) {
  return static_cast<uint32_t>((col / 64) * rows * 128 + (col % 64) * 2);
}

// An mma.sync accumulator array [tiles][tiles][4] as the flat accumulator of one wgmma.
template <int M, int N>
__device__ __forceinline__ float (&flat(float (&acc)[M][N][4]))[M * N * 4] {
  return reinterpret_cast<float(&)[M * N * 4]>(acc);
}

// An mma.sync accumulator array [tiles][4] (one 16-row tile) as the flat accumulator of one wgmma.
template <int N>
__device__ __forceinline__ float (&flat(float (&acc)[N][4]))[N * 4] {
  return reinterpret_cast<float(&)[N * 4]>(acc);
}

// Issues the wgmmas that `issue` issues as one group, not waited for: the accumulators may be
// read after wgmma_wait<n> (n = the groups issued after this one) and fence_operands.
template <typename Issue, int... R>
__device__ __forceinline__ void wgmma_async(Issue issue, float (&... acc)[R]) {
  (fence_operands(acc), ...);
  wgmma_fence();
  issue();
  wgmma_commit();
}
// wgmma_async, then waits for every group.
template <typename Issue, int... R>
__device__ __forceinline__ void wgmma_group(Issue issue, float (&... acc)[R]) {
  wgmma_async(issue, acc...);
  wgmma_wait<0>();
  (fence_operands(acc), ...);
}

// acc += A B (kOverwrite: acc = A B, acc's values unread) over kSteps k-steps of 16, operands in
// shared memory: the wgmmas are issued, not waited for (inside wgmma_async or wgmma_group, so
// several GEMMs can be in flight). a_step(ks) / b_step(ks): the byte offset of k-step ks from
// the descriptors a / b.
template <int kTA, int kTB, int kSteps, bool kOverwrite = false, int R, typename T,
          typename AStep, typename BStep>
__device__ __forceinline__ void wgmma_issue(float (&acc)[R], uint64_t a, uint64_t b,
                                            AStep a_step, BStep b_step, T tag) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    wgmma_ss<kTA, kTB>(acc, gmma_advance(a, a_step(ks)), gmma_advance(b, b_step(ks)),
                       !kOverwrite || ks > 0, tag);
  }
}

// acc += A B over kSteps k-steps of 16, A from registers (a[ks]: k-step ks's fragment), B in
// shared memory.
template <int kTB, int kSteps, int R, typename T, typename BStep>
__device__ __forceinline__ void wgmma_issue_rs(float (&acc)[R], const uint32_t (&a)[kSteps][4],
                                               uint64_t b, BStep b_step, T tag) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    wgmma_rs<kTB>(acc, a[ks], gmma_advance(b, b_step(ks)), true, tag);
  }
}

#undef DMATTN_SM90A_ASM

}  // namespace dmattn::cuda::detail
