// Device primitives shared by the forward and backward kernels: SM80 tensor-core MMA
// (mma.sync m16n8k16, fp32 accumulate), ldmatrix, cp.async with zero-fill, the swizzled
// shared-memory tile layout, and the predicated loaders for the broadcast mask / bias tiles.
//
// The instructions are issued through inline PTX (the same instructions CuTe's SM80 atoms wrap);
// the index math is explicit so that each translation unit compiles in well under a minute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "cuda/kernel_params.h"

namespace dmattn::cuda::detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ------------------------------------------------------------------------------------------
// Element types
// ------------------------------------------------------------------------------------------
template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  static constexpr uint32_t kNegInfPair = 0xff80ff80u;  // -inf in both halves
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&u);
    return __bfloat1622float2(v);
  }
  // A bf16 is the top half of its float: one shift and one AND (the intrinsic's byte permute
  // and shift take three instructions a pair; the FlashAttention-2-class backward, at its
  // register limit, runs slower with this form, so it keeps the intrinsic).
  static __device__ __forceinline__ float2 unpack_fast(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Elem<__half> {
  static constexpr uint32_t kNegInfPair = 0xfc00fc00u;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    __half2 v = *reinterpret_cast<__half2*>(&u);
    return __half22float2(v);
  }
  static __device__ __forceinline__ float2 unpack_fast(uint32_t u) { return unpack(u); }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ------------------------------------------------------------------------------------------
// Shared memory, ldmatrix, cp.async
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Stores four 8 x 8 matrices of 16-bit elements transposed: r[j] holds this thread's pair of
// matrix j in the mma fragment layout (row lane / 4, columns 2 (lane % 4), +1), and lane l gives
// the shared address of the 16-byte row l % 8 of destination matrix l / 8, which receives
// column l % 8 of the fragment. sm_80 has no stmatrix: its stores are spelled out.
__device__ __forceinline__ void stsm_x4_t(uint32_t addr, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
               ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
#else
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t row = __shfl_sync(0xffffffffu, addr, 8 * j + 2 * (lane & 3) + k);
      const uint16_t x = static_cast<uint16_t>(r[j] >> (16 * k));
      asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(row + 2 * (lane >> 2)), "h"(x));
    }
  }
#endif
}

// 16-byte async copy; bytes beyond src_bytes (0..16) are zero-filled and never read.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// 4-byte async copy with zero-fill.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh.approx: one MUFU op, relative error below 2^-10.9 (PTX ISA).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh through exp2: accurate to a few ulp of 1 (the approx tanh instruction is ~2^-11).
__device__ __forceinline__ float accurate_tanh(float x) {
  const float e = fast_exp2(2.f * kLog2e * x);
  return 1.f - __fdividef(2.f, e + 1.f);
}

// ------------------------------------------------------------------------------------------
// Swizzled tile of ROWS x COLS 16-bit elements, COLS a multiple of 32.
//
// Stored as COLS/KB column blocks of [ROWS][KB]; inside a block the 16-byte chunk index is
// XOR-ed with a function of the row, so the 8 row addresses of one ldmatrix (8 consecutive
// rows, same logical chunk) hit 8 distinct 16-byte bank groups.
// ------------------------------------------------------------------------------------------
template <int ROWS, int COLS>
struct SwizzledTile {
  static_assert(COLS % 32 == 0, "tile width must be a multiple of 32");
  static constexpr int KB = (COLS % 64 == 0) ? 64 : 32;
  static constexpr int kElems = ROWS * COLS;
  static constexpr int kBytes = kElems * 2;
  // Element offset of (r, c); c's chunk (c / 8) is swizzled, c % 8 kept.
  static __device__ __forceinline__ int off(int r, int c) {
    const int cb = c / KB;
    const int cc = c % KB;
    const int chunk = cc >> 3;
    const int sw = (KB == 64) ? (r & 7) : ((r >> 1) & 3);
    return cb * (ROWS * KB) + r * KB + ((chunk ^ sw) << 3) + (cc & 7);
  }
};

// Loads a ROWS x COLS tile of a row-major [*, row_stride] 16-bit matrix into a swizzled tile;
// rows >= valid_rows are zero-filled (their source is never read). kBounded = false: the caller
// knows every row valid, and the loads carry no bounds test.
template <int ROWS, int COLS, int NT, bool kBounded = true, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride,
                                                int valid_rows, int tid) {
  using Tile = SwizzledTile<ROWS, COLS>;
  constexpr int kChunksPerRow = COLS / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % NT == 0, "tile chunks must divide among the threads");
  if constexpr (NT % kChunksPerRow == 0 && (NT / kChunksPerRow) % 8 == 0) {
    // Each thread keeps one column and steps down by a multiple of 8 rows: the swizzle phase
    // is fixed, so the shared address advances by a constant.
    constexpr int kRowStep = NT / kChunksPerRow;
    const int r = tid / kChunksPerRow;
    const int c = (tid % kChunksPerRow) * 8;
    const uint32_t dst = smem_u32(smem + Tile::off(r, c));
    const T* src = gmem + r * row_stride + c;
    const int64_t step = kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < kChunks / NT; ++i) {
      const bool ok = !kBounded || r + i * kRowStep < valid_rows;
      cp_async16(dst + i * kRowStep * Tile::KB * 2, ok ? src : gmem, ok ? 16 : 0);
      src += step;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunks / NT; ++i) {
      const int id = tid + i * NT;
      const int r = id / kChunksPerRow;
      const int c = (id % kChunksPerRow) * 8;
      const bool ok = !kBounded || r < valid_rows;
      const T* src = ok ? gmem + r * row_stride + c : gmem;
      cp_async16(smem_u32(smem + Tile::off(r, c)), src, ok ? 16 : 0);
    }
  }
}

// ldmatrix addressing into a SwizzledTile<ROWS, COLS> for one thread: the thread supplies the
// row `row` (its lane part; any warp base must be a multiple of 8) and the column
// col_base + c0 + lane_c, lane_c in {0, 8}, col_base and c0 multiples of 16.
//
// kFold (the default): the swizzle of col_base is folded into one per-thread base register and
// each fragment address is that register XOR an immediate plus an immediate, so the unrolled
// loops need no register per address. Requires col_base to be a multiple of a power of two
// above every c0 used with it (always true for col_base == 0) and the tile to start on a row
// boundary of 128 (KB = 64) / 64 (KB = 32) bytes. Without kFold, col_base is added at run time.
template <int ROWS, int COLS, bool kFold = true>
struct FragAddr {
  using Tile = SwizzledTile<ROWS, COLS>;
  static constexpr int KB = Tile::KB;
  uint32_t base;  // kFold: row start, col_base's block and swizzled chunk; else: row start
  uint32_t y;     // swizzle XOR of the chunk index (unused with kFold)
  int col_base;
  __device__ __forceinline__ FragAddr(const void* tile, int row, int lane_c, int col_base_ = 0)
      : col_base(col_base_) {
    const int sw = (KB == 64) ? (row & 7) : ((row >> 1) & 3);
    y = static_cast<uint32_t>((lane_c >> 3) ^ sw);
    base = smem_u32(tile) + static_cast<uint32_t>(row * KB * 2);
    if constexpr (kFold) {
      base += static_cast<uint32_t>((col_base_ / KB) * ROWS * KB * 2) +
              ((y ^ static_cast<uint32_t>((col_base_ % KB) >> 3)) << 4);
    }
  }
  // Address of the fragment whose first row is r0 (a multiple of 8) and first column c0.
  __device__ __forceinline__ uint32_t operator()(int r0, int c0) const {
    if constexpr (kFold) {
      return (base ^ (static_cast<uint32_t>((c0 % KB) >> 3) << 4)) +
             static_cast<uint32_t>((r0 * KB + (c0 / KB) * ROWS * KB) * 2);
    } else {
      const int c = col_base + c0;
      return base + static_cast<uint32_t>((r0 * KB + (c / KB) * ROWS * KB) * 2) +
             ((static_cast<uint32_t>((c % KB) >> 3) ^ y) << 4);
    }
  }
};

// Stores a ROWS x COLS swizzled tile to a row-major matrix, rows < valid_rows only.
template <int ROWS, int COLS, int NT, typename T>
__device__ __forceinline__ void store_tile(T* gmem, const T* smem, int64_t row_stride,
                                           int valid_rows, int tid) {
  using Tile = SwizzledTile<ROWS, COLS>;
  constexpr int kChunksPerRow = COLS / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int i = 0; i < kChunks / NT; ++i) {
    const int id = tid + i * NT;
    const int r = id / kChunksPerRow;
    const int c = (id % kChunksPerRow) * 8;
    if (r < valid_rows) {
      const uint4 v = *reinterpret_cast<const uint4*>(smem + Tile::off(r, c));
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c) = v;
    }
  }
}

// Stores rows [0, valid_rows) x columns [0, valid_cols) of a ROWS x COLS shared tile of 16-bit
// elements (row pitch PITCH) to a row-major matrix, in 16-byte chunks: valid_cols, row_stride and
// the address of gmem must allow them.
template <int ROWS, int COLS, int PITCH, int NT, typename T>
__device__ __forceinline__ void store_padded_tile(T* gmem, int64_t row_stride, const T* smem,
                                                  int valid_rows, int valid_cols, int tid) {
  static_assert(sizeof(T) == 2 && COLS % 8 == 0 && PITCH % 8 == 0, "16-byte chunks");
  constexpr int kChunksPerRow = COLS / 8;
  static_assert(ROWS * kChunksPerRow % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int i = 0; i < ROWS * kChunksPerRow / NT; ++i) {
    const int id = tid + i * NT;
    const int r = id / kChunksPerRow, c = (id % kChunksPerRow) * 8;
    if (r < valid_rows && c < valid_cols) {
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c) =
          *reinterpret_cast<const uint4*>(smem + r * PITCH + c);
    }
  }
}

// Zeros rows [r_begin, r_end) x columns [0, cols) of a row-major matrix of 16-bit elements,
// spread over the CTA's NT threads: 16-byte stores where every row start allows them.
template <int NT, typename T>
__device__ __forceinline__ void zero_rows(T* gmem, int64_t row_stride, int r_begin, int r_end,
                                          int cols, int tid) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  const bool vec = row_stride % 8 == 0 && cols % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(gmem) % 16 == 0;
  const int per_row = vec ? cols / 8 : cols;
  const int64_t total = static_cast<int64_t>(r_end - r_begin) * per_row;
  for (int64_t id = tid; id < total; id += NT) {
    const int64_t r = r_begin + id / per_row;
    const int c = static_cast<int>(id % per_row);
    if (vec) {
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c * 8) = make_uint4(0, 0, 0, 0);
    } else {
      *reinterpret_cast<uint16_t*>(gmem + r * row_stride + c) = 0;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Broadcast operand tiles (mask: 1-byte bool, bias: 16-bit), [ROWS][COLS] in shared memory
// with a padded row pitch SROW (elements). Element (r, c) of the tile is
// base[r * rs + c * cs] for r < valid_rows, c < valid_cols, zero elsewhere.
// `vec`: cs == 1, rs and the base offset are multiples of 16 bytes; loads go through 16-byte
// cp.async (async; visible after cp_async_wait + __syncthreads). Otherwise every element is
// loaded with a plain predicated load and stored to shared memory right away (visible after
// the next __syncthreads). With `one_row` (rs == 0) only row 0 is loaded.
// kFixedColumns: the 16-byte chunks go to the same threads, but each thread keeps one column
// chunk and steps down the rows in a fully unrolled loop (a row test and an add per chunk
// instead of a division and 64-bit address math), for kernels with the registers to spare.
// ------------------------------------------------------------------------------------------
template <int ROWS, int COLS, int SROW, int NT, bool kFixedColumns = false, typename E>
__device__ __forceinline__ void load_operand_tile(E* smem, const E* base, int64_t rs, int64_t cs,
                                                  int valid_rows, int valid_cols, bool vec,
                                                  bool one_row, int tid) {
  const int rows = one_row ? 1 : ROWS;
  if (one_row) valid_rows = valid_rows > 0 ? 1 : 0;
  if (vec) {
    constexpr int kPerChunk = 16 / sizeof(E);
    constexpr int kChunksPerRow = COLS / kPerChunk;
    if constexpr (kFixedColumns && NT % kChunksPerRow == 0 && ROWS * kChunksPerRow % NT == 0) {
      if (!one_row) {
        constexpr int kRowStep = NT / kChunksPerRow;
        const int r = tid / kChunksPerRow;
        const int c = (tid % kChunksPerRow) * kPerChunk;
        int n = valid_cols - c;
        n = n < 0 ? 0 : (n > kPerChunk ? kPerChunk : n);
        const int bytes = n * static_cast<int>(sizeof(E));
        const uint32_t dst = smem_u32(smem + r * SROW + c);
        const E* src = base + r * rs + c;
#pragma unroll
        for (int i = 0; i < ROWS / kRowStep; ++i) {
          const bool ok = bytes > 0 && r + i * kRowStep < valid_rows;
          cp_async16(dst + i * kRowStep * SROW * static_cast<int>(sizeof(E)), ok ? src : base,
                     ok ? bytes : 0);
          src += kRowStep * rs;
        }
        return;
      }
    }
    const int chunks = rows * kChunksPerRow;
    for (int id = tid; id < chunks; id += NT) {
      const int r = id / kChunksPerRow;
      const int c = (id % kChunksPerRow) * kPerChunk;
      int n = valid_cols - c;
      n = n < 0 ? 0 : (n > kPerChunk ? kPerChunk : n);
      if (r >= valid_rows) n = 0;
      const E* src = n > 0 ? base + r * rs + c : base;
      cp_async16(smem_u32(smem + r * SROW + c), src, n * static_cast<int>(sizeof(E)));
    }
  } else {
    const int elems = rows * COLS;
    for (int id = tid; id < elems; id += NT) {
      const int r = id / COLS;
      const int c = id % COLS;
      E v;
      if (r < valid_rows && c < valid_cols) {
        v = base[r * rs + c * cs];
      } else {
        v = E();
        if constexpr (sizeof(E) == 2) {
          *reinterpret_cast<uint16_t*>(&v) = 0;
        } else {
          *reinterpret_cast<uint8_t*>(&v) = 0;
        }
      }
      smem[r * SROW + c] = v;
    }
  }
}

// Mask tile flags: some element true (kTileAny), every element true (kTileAll: no per-element
// test needed). Built per 64 x 64 cell by block_map.cu, read through block_map.cuh.
constexpr int kTileAny = 1, kTileAll = 2;
// A tile walk's flag beside them: the tile's index masks (segment ids, segments.cuh; the O(L)
// mask forms, mask_forms.cuh) hide some of its scores, so each is tested.
constexpr int kTileIndexed = 4;
// True when no byte of x is zero.
__device__ __forceinline__ bool no_zero_byte(uint32_t x) {
  return ((x - 0x01010101u) & ~x & 0x80808080u) == 0;
}

// ------------------------------------------------------------------------------------------
// Batch / visibility helpers
// ------------------------------------------------------------------------------------------
struct SeqLens {
  int q_len;
  int kv_len;
};

__device__ __forceinline__ SeqLens seq_lens(const AttentionShape& s, const int32_t* q_lens,
                                            const int32_t* kv_lens, int64_t b) {
  SeqLens r{static_cast<int>(s.seqlen_q), static_cast<int>(s.seqlen_k)};
  if (s.has_seqlens) {
    const int64_t o = s.seqlens_batch.offset(s.batch, b);
    if (q_lens != nullptr) {
      const int v = q_lens[o];
      r.q_len = v < 0 ? 0 : (v < r.q_len ? v : r.q_len);
    }
    if (kv_lens != nullptr) {
      const int v = kv_lens[o];
      r.kv_len = v < 0 ? 0 : (v < r.kv_len ? v : r.kv_len);
    }
  }
  return r;
}

// Visibility of key j to query i from the diagonal/window rule: dmin <= j - i <= dmax.
struct Band {
  int dmin;  // INT_MIN / 2 when unbounded
  int dmax;  // INT_MAX / 2 when unbounded
};

__host__ __device__ __forceinline__ Band make_band(const AttentionShape& s) {
  Band b;
  const int64_t lo = s.diagonal_offset - s.window_left;
  const int64_t hi = s.diagonal_offset + s.window_right;
  const int64_t big = (1ll << 30);
  b.dmin = s.window_left < 0 ? -static_cast<int>(big)
                             : static_cast<int>(lo < -big ? -big : (lo > big ? big : lo));
  b.dmax = s.window_right < 0 ? static_cast<int>(big)
                              : static_cast<int>(hi < -big ? -big : (hi > big ? big : hi));
  return b;
}

// Which keys query row i sees by position: those of the band (j - i in [dmin, dmax]) and, with a
// sink, keys j < sink wherever the call's own band (`outer`, which contains `band`) allows.
// Without a window table, band == outer and sink == 0.
struct PositionRule {
  Band band;
  Band outer;
  int sink;

  // (Kernels without a window table test the band alone, written out where they use it: a call
  // of this, even with the sink known to be 0, compiles to other code.)
  __device__ __forceinline__ bool sees(int i, int j) const {
    const int d = j - i;
    return (d >= band.dmin && d <= band.dmax) || (j < sink && d >= outer.dmin && d <= outer.dmax);
  }
};

__host__ __device__ __forceinline__ PositionRule position_rule(const Band& outer,
                                                               const HeadWindows& windows,
                                                               int hk) {
  if (windows.heads == 0) return {outer, outer, 0};
  const HeadWindow& w = windows.head[hk];
  return {{w.dmin, w.dmax}, outer, w.sink};
}
__host__ __device__ __forceinline__ PositionRule position_rule(const AttentionShape& s,
                                                               const HeadWindows& windows,
                                                               int hk) {
  return position_rule(make_band(s), windows, hk);
}

// The rule of kv head hk in a kernel that reads window tables (kTable) or not (the call's band
// alone, the sink 0 known at compile time).
template <bool kTable, typename Params>
__device__ __forceinline__ PositionRule position_rule_of(const Params& p, int hk) {
  if constexpr (kTable) {
    return position_rule(p.s, p.windows, hk);
  } else {
    const Band band = make_band(p.s);
    return {band, band, 0};
  }
}

// Key blocks [lo, hi) of width BN (lo == hi when none).
struct BlockRange {
  int lo = 0;
  int hi = 0;
};

// Key blocks [lo, hi) of width BN that the lengths and the band leave visible to some query row
// of m0 .. m0 + BM - 1.
template <int BM, int BN>
__device__ __forceinline__ BlockRange visible_key_blocks(const SeqLens& L, const Band& band,
                                                         int m0) {
  BlockRange r;
  const int row_last = min(m0 + BM, L.q_len) - 1;
  if (row_last < m0 || L.kv_len <= 0) return r;
  int64_t lo = static_cast<int64_t>(m0) + band.dmin;
  int64_t hi = static_cast<int64_t>(row_last) + band.dmax + 1;
  lo = lo < 0 ? 0 : lo;
  hi = hi > L.kv_len ? L.kv_len : hi;
  if (hi > lo) {
    r.lo = static_cast<int>(lo / BN);
    r.hi = static_cast<int>((hi + BN - 1) / BN);
  }
  return r;
}

// Key blocks [lo, hi) that a walk steps over (none when lo == hi == 0): from the last block to the
// first, a walk goes on below the gap.
struct KeyGap {
  int lo = 0;
  int hi = 0;

  __device__ __forceinline__ bool holds(int n) const { return n < hi && n >= lo; }
  // The last block at or below n outside the gap (the next one of a walk without a mask).
  __device__ __forceinline__ int at_or_below(int n) const { return n < hi ? min(n, lo - 1) : n; }
  // The next block of a walk at or below n, outside the gap; walk_next(n, flags): the walk's own
  // next block at or below n (the one the mask leaves visible; its end when none is) and its
  // flags. A walk that stops inside the gap (a key split starting there) returns its end from
  // the second trip, below its first block. (One call site of walk_next, which kernels inline.)
  template <typename WalkNext>
  __device__ __forceinline__ int next(int n, int* flags, WalkNext&& walk_next) const {
    for (int trip = 0;; ++trip, n = lo - 1) {
      n = walk_next(at_or_below(n), flags);
      if (trip > 0 || !holds(n)) return n;
    }
  }
  // The same for a walk up the keys (the softmax-threshold kernels): at or above n.
  __device__ __forceinline__ int at_or_above(int n) const { return n >= lo ? max(n, hi) : n; }
  template <typename WalkNext>
  __device__ __forceinline__ int next_up(int n, int* flags, WalkNext&& walk_next) const {
    for (int trip = 0;; ++trip, n = hi) {
      n = walk_next(at_or_above(n), flags);
      if (trip > 0 || !holds(n)) return n;
    }
  }
};

// The key blocks a rule leaves visible to some row of m0 .. m0 + BM - 1: those of its band and
// of its sink, [all.lo, all.hi) less the blocks of the gap between the two that neither reaches
// (empty without a sink, or where the two meet).
struct KeyBlocks {
  BlockRange all;
  KeyGap gap;
};

template <int BM, int BN, bool kSinks = true>
__device__ __forceinline__ KeyBlocks visible_key_blocks(const SeqLens& L, const PositionRule& rule,
                                                        int m0) {
  KeyBlocks r;
  r.all = visible_key_blocks<BM, BN>(L, rule.band, m0);
  if (!kSinks || rule.sink <= 0) return r;
  const SeqLens sink_lens{L.q_len, min(L.kv_len, rule.sink)};
  const BlockRange sink = visible_key_blocks<BM, BN>(sink_lens, rule.outer, m0);
  if (sink.hi <= sink.lo) return r;
  if (r.all.hi <= r.all.lo) {
    r.all = sink;
  } else if (sink.hi < r.all.lo) {  // the band starts above the sink's last block
    r.gap = {sink.hi, r.all.lo};
    r.all.lo = sink.lo;
  } else {
    r.all = {min(r.all.lo, sink.lo), max(r.all.hi, sink.hi)};
  }
  return r;
}

// ------------------------------------------------------------------------------------------
// Loops over a warp's mma accumulator tiles [M][N][4], unrolled so that f sees constants
// ------------------------------------------------------------------------------------------
// f(mt, t, k) for every mt < M, t < N, k < K.
template <int M, int N, int K, typename F>
__device__ __forceinline__ void for_each_index(F f) {
#pragma unroll
  for (int mt = 0; mt < M; ++mt)
#pragma unroll
    for (int t = 0; t < N; ++t)
#pragma unroll
      for (int k = 0; k < K; ++k) f(mt, t, k);
}
// f(mt, t, e) for every element.
template <int M, int N, typename F>
__device__ __forceinline__ void for_each_element(F f) {
  for_each_index<M, N, 4>(f);
}
// f(mt, t, h) for every pair of elements 2 h, 2 h + 1 (one row, two adjacent columns).
template <int M, int N, typename F>
__device__ __forceinline__ void for_each_pair(F f) {
  for_each_index<M, N, 2>(f);
}

// ------------------------------------------------------------------------------------------
// Online softmax over one key block, on a warp's accumulators of MT x 16 rows (two rows a thread
// per 16: lane / 4 and lane / 4 + 8; the row's other columns on the lanes of its quad)
// ------------------------------------------------------------------------------------------
// Each row's running max (in accumulator units) and sum take in the block's scores, which become
// exp2((s - max) * softmax_mul); O is rescaled by the change of max. A row with no visible score
// yet keeps max -inf and sum 0.
// kSkipHeld: a row whose max held keeps its sum's factor exactly 1, and O is rescaled only where
// some row of the warp has a max that grew (in decoding, after the first tiles, rarely: 64 of a
// warp's ~700 instructions a tile).
template <int MT, int NTS, int NTO, bool kSkipHeld = false>
__device__ __forceinline__ void online_softmax(float (&sc)[MT][NTS][4], float (&row_m)[2 * MT],
                                               float (&row_l)[2 * MT], float (&o)[MT][NTO][4],
                                               float softmax_mul) {
  float corrs[2 * MT];
  bool grew = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * mt + half;
      float mx = row_m[r];
#pragma unroll
      for (int t = 0; t < NTS; ++t) {
        mx = fmaxf(mx, fmaxf(sc[mt][t][2 * half], sc[mt][t][2 * half + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_sc = (mx == -INFINITY) ? 0.f : mx * softmax_mul;
      float corr = fast_exp2(row_m[r] * softmax_mul - m_sc);
      if constexpr (kSkipHeld) {
        grew = grew || mx != row_m[r];
        if (mx == row_m[r]) corr = 1.f;
      }
      corrs[r] = corr;
      row_m[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < NTS; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = fast_exp2(sc[mt][t][2 * half + e] * softmax_mul - m_sc);
          sc[mt][t][2 * half + e] = pv;
          sum += pv;
        }
      }
      row_l[r] = row_l[r] * corr + sum;
      if constexpr (!kSkipHeld) {
#pragma unroll
        for (int t = 0; t < NTO; ++t) {
          o[mt][t][2 * half] *= corr;
          o[mt][t][2 * half + 1] *= corr;
        }
      }
    }
  }
  if constexpr (kSkipHeld) {
    if (!__any_sync(0xffffffffu, grew)) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NTO; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][t][e] *= corrs[2 * mt + e / 2];
  }
}

}  // namespace dmattn::cuda::detail
