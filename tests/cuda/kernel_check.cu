// Standalone check of the CUDA kernels (dmattn::cuda::Forward / Backward) against a host
// double-precision reference. See tests/cuda/README.md for the build command.
//
//   kernel_check            all cases whose (head dim, dtype) is compiled in; exit 1 on failure
//   kernel_check --quick    a few tiny irregular cases and the dynamic-mask kernels (for
//                           compute-sanitizer)
//   kernel_check --bench    also time a few large shapes (no reference)
//   kernel_check --only S   run the cases (and benchmarks) whose name contains S (--case S:
//                           exactly S)
//   kernel_check --list     print the case names; --bench-only: the benchmarks alone
//   kernel_check --variants also check / time the alternative tiles of a tuning build
//                           (-DDMATTN_CUDA_TUNING with tests/cuda/tune_*.cu)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/params.h"
#include "cuda/attention.h"
#include "cuda/dynamic.h"
#include "cuda/launch.h"

using dmattn::AttentionShape;
using dmattn::BackwardArgs;
using dmattn::BatchStrides;
using dmattn::BroadcastOperand;
using dmattn::ElementType;
using dmattn::ForwardArgs;

#if defined(DMATTN_CUDA_TUNING)
namespace dmattn::cuda {
int TuningVariants(bool backward, int head_dim);  // tests/cuda/tune_fwd.cu
}
int NumVariants(bool backward, int64_t head_dim, bool bf16) {
  return bf16 ? dmattn::cuda::TuningVariants(backward, static_cast<int>(head_dim)) : 0;
}
#else
int NumVariants(bool, int64_t, bool) { return 0; }
#endif
void SetVariant(int v) {
  if (v > 0) {
    setenv("DMATTN_CUDA_VARIANT", std::to_string(v).c_str(), 1);
  } else {
    unsetenv("DMATTN_CUDA_VARIANT");
  }
}

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, cudaGetErrorString(e_));                                    \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

namespace {

// ---------------------------------------------------------------------------------------------
// 16-bit conversions (host)
// ---------------------------------------------------------------------------------------------
uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float bf2f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }
float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

struct Dtype {
  bool bf16;
  uint16_t enc(float f) const { return bf16 ? f2bf(f) : f2h(f); }
  float dec(uint16_t h) const { return bf16 ? bf2f(h) : h2f(h); }
};

// ---------------------------------------------------------------------------------------------
// Case description
// ---------------------------------------------------------------------------------------------
struct OperandSpec {
  bool present = false;
  std::vector<int64_t> batch;  // per batch dim: full size or 1
  int64_t heads = 1;           // H, Hk or 1
  bool rows = true;            // full Lq, else 1
  bool cols = true;            // full Lk, else 1
};

struct Case {
  std::string name;
  bool bf16 = true;
  std::vector<int64_t> batch = {1};
  std::vector<int64_t> kv_batch;  // empty: same as batch
  std::vector<int64_t> dkv_batch;  // dk/dv batch dims; empty: same as kv_batch (vmap: full)
  std::vector<int64_t> dbias_batch;  // dbias batch dims; empty: same as the bias's
  int64_t H = 2, Hk = 2, Lq = 64, Lk = 64, D = 64;
  OperandSpec mask, bias;
  float mask_density = 0.7f;
  bool mask_holes = false;  // fully false rows and 64x64 tiles
  float block_density = 0.f;  // > 0: mask made of 128x128 all-true / all-false blocks
  // > 0: a mask of whole 128-key columns, every query seeing the same key blocks: every
  // key_block_step-th block, or (key_blocks_first) the first 1 / key_block_step of them
  int key_block_step = 0;
  bool key_blocks_first = false;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.f;
  bool seqlens = false;
  std::vector<int32_t> q_lens, kv_lens;
  bool deterministic = false;
  bool dlse = false;
  float qk_std = 1.f;
  bool dbias = true;  // false: the bias is not differentiated (the backward gets no dbias)
  // Segment ids (0 documents: none): packed documents of random lengths (monotone ids), ids
  // drawn at random per position (seg_random: every tile's spans overlap), one id row for the
  // whole batch (seg_shared); seg_orphans: some query ids that no key has; seg_even: documents
  // of equal length.
  int seg_docs = 0;
  bool seg_random = false, seg_shared = false, seg_orphans = false, seg_even = false;
  // Per-kv-head windows with sinks (AttentionShape::head_windows): Hk rows (sink, left, right);
  // empty: none.
  std::vector<std::array<int64_t, 3>> head_windows;
  // The O(L) mask forms (AttentionShape::key_ranges, row_ranges, block_indices), each over its
  // spec's batch dims and heads (rows / cols unused; see Form), values drawn by DrawRanges and
  // DrawBlockIndices; block indices list block_slots key blocks of block_k keys per query block
  // of block_q rows.
  OperandSpec key_ranges, row_ranges, block_indices;
  int64_t block_q = 64, block_k = 64, block_slots = 4;
  bool key_ranges_all = false;  // every key seen by every row (benchmarks: the forms' kernels)
  // Gated attention (AttentionShape::has_gate): alpha [B, Lq, H] and delta [B, Lk, Hk] drawn
  // normal with std gate_std. With a cut (gate_cut > -inf), alpha is 0.5 + |normal| and the
  // delta of the 128-key grid blocks but every gate_keep_every-th lies 6 lower, so that the cut
  // drops those blocks whole and keeps the others. dalpha / ddelta are compared too.
  bool gate = false;
  float gate_std = 1.f;
  double gate_cut = -INFINITY;
  int gate_keep_every = 2;
};

int64_t Prod(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (auto x : v) p *= x;
  return p;
}

// Natural strides over the batch dims of an operand whose batch dims are `dims`, trailing
// block `inner` elements; 0 where the dim is 1.
BatchStrides Strides(const std::vector<int64_t>& dims, int64_t inner) {
  BatchStrides s;
  int64_t st = inner;
  for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
    s.strides[d] = dims[d] == 1 ? 0 : st;
    st *= dims[d];
  }
  return s;
}

struct Problem {
  Case c;
  AttentionShape s;
  Dtype dt;
  int64_t B;  // flat batch count
  std::vector<int64_t> mask_batch, bias_batch, dbias_batch;
  int64_t q_elems, kv_elems, dkv_elems, mask_elems = 0, bias_elems = 0, dbias_elems = 0;
  // host data
  std::vector<uint16_t> q, k, v, bias, dout;
  std::vector<uint8_t> mask;
  std::vector<float> dlse;
  std::vector<int32_t> q_lens, kv_lens;
  std::vector<int32_t> q_seg, kv_seg;  // [segment rows, Lq] / [segment rows, Lk]
  std::vector<int32_t> key_start, key_end, row_start, row_end, block_indices;  // the forms
  std::vector<float> alpha, delta;  // the gate
  // The case's table, flat; s.head_windows points into it (shared: copies keep it alive).
  std::shared_ptr<std::vector<int64_t>> head_windows;
};

// An operand [*bdims, sp.heads, rows, cols], contiguous, with strides 0 on its size-1 dims.
BroadcastOperand Layout(const OperandSpec& sp, const Case& c, const std::vector<int64_t>& bdims,
                        int64_t rows, int64_t cols) {
  BroadcastOperand op;
  op.present = true;
  op.batch = Strides(bdims, sp.heads * rows * cols);
  op.heads_per_entry = c.H / sp.heads;
  op.head_stride = rows * cols;
  op.row_stride = rows == 1 ? 0 : cols;
  op.col_stride = cols == 1 ? 0 : 1;
  op.num_elements = Prod(bdims) * sp.heads * rows * cols;
  return op;
}

std::vector<int64_t> OperandBatch(const OperandSpec& sp, const Case& c) {
  return sp.batch.empty() ? c.batch : sp.batch;
}

BroadcastOperand MakeOperand(const OperandSpec& sp, const Case& c, std::vector<int64_t>* bdims,
                             int64_t* elems) {
  if (!sp.present) return BroadcastOperand{};
  *bdims = OperandBatch(sp, c);
  const BroadcastOperand op = Layout(sp, c, *bdims, sp.rows ? c.Lq : 1, sp.cols ? c.Lk : 1);
  *elems = op.num_elements;
  return op;
}

// Ids 0..docs-1 of `len` positions: packed documents (sorted, at random boundaries, the first of
// length 1 where possible; equal lengths with `even`), or drawn at random per position.
std::vector<int32_t> Packing(std::mt19937_64& rng, int64_t len, int docs, bool random, bool even) {
  std::vector<int32_t> ids(len);
  if (random) {
    for (auto& x : ids) x = static_cast<int32_t>(rng() % docs);
    return ids;
  }
  std::vector<int64_t> starts = {0};
  if (even) {
    for (int d = 1; d < docs; ++d) starts.push_back(len * d / docs);
  } else {
    if (docs > 1 && len > 1) starts.push_back(1);
    while (static_cast<int>(starts.size()) < docs && static_cast<int64_t>(starts.size()) < len) {
      const int64_t cut = 1 + static_cast<int64_t>(rng() % (len - 1));
      if (std::find(starts.begin(), starts.end(), cut) == starts.end()) starts.push_back(cut);
    }
    std::sort(starts.begin(), starts.end());
  }
  for (int64_t i = 0, d = 0; i < len; ++i) {
    while (d + 1 < static_cast<int64_t>(starts.size()) && i >= starts[d + 1]) ++d;
    ids[i] = static_cast<int32_t>(d);
  }
  return ids;
}

void MakeSegments(const Case& c, std::mt19937_64& rng, Problem* P) {
  AttentionShape& s = P->s;
  s.has_segments = true;
  const std::vector<int64_t> rows_dims =
      c.seg_shared ? std::vector<int64_t>(c.batch.size(), 1) : c.batch;
  s.segments_batch = Strides(rows_dims, 1);
  for (int64_t r = 0; r < Prod(rows_dims); ++r) {
    std::vector<int32_t> q = Packing(rng, c.Lq, c.seg_docs, c.seg_random, c.seg_even);
    const std::vector<int32_t> k = Packing(rng, c.Lk, c.seg_docs, c.seg_random, c.seg_even);
    if (c.seg_orphans) {  // a whole document and a single row of ids no key has
      for (int64_t i = 0; i < std::max<int64_t>(1, c.Lq / 5); ++i) q[i] = 100 + static_cast<int32_t>(r);
      q[c.Lq - 1] = -7;
    }
    P->q_seg.insert(P->q_seg.end(), q.begin(), q.end());
    P->kv_seg.insert(P->kv_seg.end(), k.begin(), k.end());
  }
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Ranges [start, end) into `span` positions (query rows for key ranges, keys for row ranges) for
// `entries` rows of `n` positions, in runs of positions that share a kind: a band about the
// scaled diagonal (tiles far from it hidden, those on it partly) or a random range, both shifted
// by a few positions at each position; all of the span from outside it or from an int32 limit
// (the kernels must not overflow); empty ones (start == end, start > end, wholly before 0 or
// past the span). Then positions [span / 3, span / 2) (from a span of 8) are cut out of every
// range: whole tiles of rows (key ranges) or keys (row ranges) take part in no score.
void DrawRanges(std::mt19937_64& rng, int64_t entries, int64_t n, int64_t span,
                std::vector<int32_t>* start, std::vector<int32_t>* end) {
  auto draw = [&](int64_t a, int64_t b) { return a + static_cast<int64_t>(rng() % (b - a + 1)); };
  constexpr int64_t kLow = INT32_MIN, kHigh = INT32_MAX;
  const int64_t cut0 = span / 3, cut1 = span >= 8 ? span / 2 : cut0;
  for (int64_t e = 0; e < entries; ++e) {
    for (int64_t p = 0; p < n;) {
      const int64_t run = std::min(n - p, draw(1, rng() % 2 ? 8 : std::max<int64_t>(1, n / 5)));
      const int64_t kind = draw(0, 9), w0 = draw(0, span / 3 + 1), w1 = draw(1, span / 3 + 1);
      const int64_t a = draw(-3, span), b = draw(a, span + 3);
      const bool low = rng() % 2;
      auto range = [&](int64_t centre) -> std::pair<int64_t, int64_t> {
        const int64_t shift = draw(-2, 2);
        switch (kind) {
          case 0: case 1: case 2: case 3: return {centre - w0 + shift, centre + w1 + shift};
          case 4: case 5: return {a + shift, b + shift};
          case 6: return {-1 - w0, span + w1};
          case 7: return low ? std::make_pair(kLow, b) : std::make_pair(a, kHigh);
          case 8: return low ? std::make_pair(a, a) : std::make_pair(b, a - 1);
          default:
            return low ? std::make_pair(-w0 - w1, -w0) : std::make_pair(span + w0, span + w1 + w0);
        }
      };
      for (int64_t r = 0; r < run; ++r, ++p) {
        auto [lo, hi] = range(p * span / n);
        if (std::max(lo, cut0) < std::min(hi, cut1)) {  // keep the larger side of the cut
          if (cut0 - lo >= hi - cut1) {
            hi = cut0;
          } else {
            lo = cut1;
          }
        }
        start->push_back(static_cast<int32_t>(lo));
        end->push_back(static_cast<int32_t>(hi));
      }
    }
  }
}

// Block indices [entries, nqb, slots] for nkb key blocks: per query block, distinct blocks in a
// random order (-1 past them), then slot by slot some made -1, a repeat of an earlier slot of
// the row, or a value naming no block (nkb, -2, the int32 limits). No query block lists key
// block nkb / 3 (from 3 blocks) and every fifth query block from the fourth lists nothing, so
// that some keys and some rows see nothing.
std::vector<int32_t> DrawBlockIndices(std::mt19937_64& rng, int64_t entries, int64_t nqb,
                                      int64_t slots, int64_t nkb) {
  std::vector<int32_t> blocks;
  for (int64_t m = 0; m < nkb; ++m) {
    if (nkb < 3 || m != nkb / 3) blocks.push_back(static_cast<int32_t>(m));
  }
  const int32_t none[] = {static_cast<int32_t>(nkb), -2, INT32_MIN, INT32_MAX};
  std::vector<int32_t> out;
  for (int64_t row = 0; row < entries * nqb; ++row) {
    std::shuffle(blocks.begin(), blocks.end(), rng);
    const size_t first = out.size();
    const bool empty = nqb >= 4 && row % nqb % 5 == 3;
    for (int64_t k = 0; k < slots; ++k) {
      int32_t x = k < static_cast<int64_t>(blocks.size()) ? blocks[k] : -1;
      const uint64_t u = rng() % 8;
      if (u == 0) x = -1;
      if (u == 1 && k > 0) x = out[first + rng() % k];
      if (u == 2) x = none[rng() % 4];
      out.push_back(empty ? -1 : x);
    }
  }
  return out;
}

// The O(L) mask forms, laid out as DecodeRanges / DecodeBlockIndices (csrc/ffi/decode.cc) lay
// out the arrays key_start / key_end [*, 1, Lk], row_start / row_end [*, Lq, 1] and block
// indices [*, ceil(Lq / block_q), K].
void MakeForms(const Case& c, std::mt19937_64& rng, Problem* P) {
  AttentionShape& s = P->s;
  if (c.key_ranges.present) {
    s.key_ranges = Layout(c.key_ranges, c, OperandBatch(c.key_ranges, c), 1, c.Lk);
    DrawRanges(rng, s.key_ranges.num_elements / c.Lk, c.Lk, c.Lq, &P->key_start, &P->key_end);
    if (c.key_ranges_all) {
      std::fill(P->key_start.begin(), P->key_start.end(), 0);
      std::fill(P->key_end.begin(), P->key_end.end(), static_cast<int32_t>(c.Lq));
    }
  }
  if (c.row_ranges.present) {
    s.row_ranges = Layout(c.row_ranges, c, OperandBatch(c.row_ranges, c), c.Lq, 1);
    DrawRanges(rng, s.row_ranges.num_elements / c.Lq, c.Lq, c.Lk, &P->row_start, &P->row_end);
  }
  if (c.block_indices.present) {
    const int64_t nqb = CeilDiv(c.Lq, c.block_q);
    BroadcastOperand& op = s.block_indices;
    op = Layout(c.block_indices, c, OperandBatch(c.block_indices, c), nqb, c.block_slots);
    op.row_stride = c.block_slots;  // as the FFI's, also where nqb or K is 1
    op.col_stride = 1;
    s.block_q = c.block_q;
    s.block_k = c.block_k;
    s.block_slots = c.block_slots;
    P->block_indices = DrawBlockIndices(rng, op.num_elements / (nqb * c.block_slots), nqb,
                                        c.block_slots, CeilDiv(c.Lk, c.block_k));
  }
}

Problem Build(const Case& c, uint64_t seed, bool fast = false) {
  Problem P;
  P.c = c;
  P.dt.bf16 = c.bf16;
  AttentionShape& s = P.s;
  s.batch.rank = static_cast<int32_t>(c.batch.size());
  for (size_t d = 0; d < c.batch.size(); ++d) s.batch.sizes[d] = c.batch[d];
  s.seqlen_q = c.Lq;
  s.seqlen_k = c.Lk;
  s.num_heads = c.H;
  s.num_kv_heads = c.Hk;
  s.head_dim = c.D;
  s.dtype = c.bf16 ? ElementType::kBFloat16 : ElementType::kFloat16;
  const std::vector<int64_t> kvb = c.kv_batch.empty() ? c.batch : c.kv_batch;
  s.kv_batch = Strides(kvb, c.Lk * c.Hk * c.D);
  s.scale = 1.f / std::sqrt(static_cast<float>(c.D));
  s.softcap = c.softcap;
  s.diagonal_offset = c.causal ? (c.Lk - c.Lq) : 0;
  s.window_left = c.window_left;
  s.window_right = c.causal ? 0 : c.window_right;
  s.deterministic = c.deterministic;
  if (!c.head_windows.empty()) {
    P.head_windows = std::make_shared<std::vector<int64_t>>();
    for (const auto& row : c.head_windows) {
      P.head_windows->insert(P.head_windows->end(), row.begin(), row.end());
    }
    s.head_windows = P.head_windows->data();
  }
  s.mask = MakeOperand(c.mask, c, &P.mask_batch, &P.mask_elems);
  s.bias = MakeOperand(c.bias, c, &P.bias_batch, &P.bias_elems);
  {
    OperandSpec ds = c.bias;
    if (!c.dbias_batch.empty()) ds.batch = c.dbias_batch;
    s.dbias = MakeOperand(ds, c, &P.dbias_batch, &P.dbias_elems);
  }
  const std::vector<int64_t> dkvb = c.dkv_batch.empty() ? kvb : c.dkv_batch;
  s.dkv_batch = Strides(dkvb, c.Lk * c.Hk * c.D);
  P.B = Prod(c.batch);
  P.q_elems = P.B * c.Lq * c.H * c.D;
  P.kv_elems = Prod(kvb) * c.Lk * c.Hk * c.D;
  P.dkv_elems = Prod(dkvb) * c.Lk * c.Hk * c.D;

  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  uint64_t st = seed * 0x9E3779B97F4A7C15ull + 1;
  auto fast_u = [&]() {  // xorshift, uniform in [0, 1)
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return static_cast<float>(st >> 40) * (1.f / 16777216.f);
  };
  auto fill = [&](std::vector<uint16_t>& x, int64_t n, float stdv) {
    x.resize(n);
    if (fast) {
      for (auto& e : x) e = P.dt.enc((fast_u() * 3.4641f - 1.7320f) * stdv);
    } else {
      for (auto& e : x) e = P.dt.enc(nd(rng) * stdv);
    }
  };
  fill(P.q, P.q_elems, c.qk_std);
  fill(P.k, P.kv_elems, c.qk_std);
  fill(P.v, P.kv_elems, 1.f);
  fill(P.dout, P.q_elems, 1.f);
  if (s.bias.present) fill(P.bias, P.bias_elems, 1.f);
  if (s.mask.present) {
    P.mask.resize(P.mask_elems);
    for (auto& e : P.mask) e = (fast ? fast_u() : ud(rng)) < c.mask_density ? 1 : 0;
    if (c.block_density > 0.f) {
      const int64_t rows = c.mask.rows ? c.Lq : 1, cols = c.mask.cols ? c.Lk : 1;
      const int64_t entries = P.mask_elems / (rows * cols);
      for (int64_t e = 0; e < entries; ++e)
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) {
            uint64_t hsh = (static_cast<uint64_t>(e) * 1000003u + (i / 128)) * 998244353u +
                           (j / 128) * 0x9E3779B97F4A7C15ull;
            hsh ^= hsh >> 29;
            hsh *= 0xBF58476D1CE4E5B9ull;
            hsh ^= hsh >> 32;
            const float u = static_cast<float>(hsh & 0xffffff) / 16777216.f;
            P.mask[(e * rows + i) * cols + j] = u < c.block_density ? 1 : 0;
          }
    }
    if (c.key_block_step > 0) {
      const int64_t cols = c.mask.cols ? c.Lk : 1, blocks = (cols + 127) / 128;
      const int64_t first = (blocks + c.key_block_step - 1) / c.key_block_step;
      for (int64_t i = 0; i < P.mask_elems; ++i) {
        const int64_t block = i % cols / 128;
        P.mask[i] = c.key_blocks_first ? block < first : block % c.key_block_step == 0;
      }
    }
    if (c.mask_holes) {
      // Walk every (entry, row, col) and clear whole rows 5..20 and 64x64 tiles whose tile
      // coordinates (ti + tj) % 3 == 1.
      const int64_t rows = c.mask.rows ? c.Lq : 1, cols = c.mask.cols ? c.Lk : 1;
      const int64_t entries = P.mask_elems / (rows * cols);
      for (int64_t e = 0; e < entries; ++e)
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) {
            const bool hole_row = rows > 1 && i >= 5 && i <= 20;
            const bool hole_tile = ((i / 64) + (j / 64)) % 3 == 1;
            if (hole_row || hole_tile) P.mask[(e * rows + i) * cols + j] = 0;
          }
    }
  }
  P.dlse.assign(P.B * c.H * c.Lq, 0.f);
  if (c.dlse)
    for (auto& e : P.dlse) e = 0.3f * nd(rng);
  if (c.seqlens) {
    s.has_seqlens = true;
    s.seqlens_batch = Strides(c.batch, 1);
    P.q_lens = c.q_lens;
    P.kv_lens = c.kv_lens;
  }
  if (c.seg_docs > 0) MakeSegments(c, rng, &P);
  MakeForms(c, rng, &P);  // drawn last: the other cases keep their inputs
  if (c.gate) {
    s.has_gate = true;
    s.gate_cut = c.gate_cut;
    P.alpha.resize(P.B * c.Lq * c.H);
    P.delta.resize(P.B * c.Lk * c.Hk);
    const bool cut = c.gate_cut > -INFINITY;
    for (auto& e : P.alpha) e = cut ? 0.5f + std::fabs(nd(rng)) : nd(rng) * c.gate_std;
    for (size_t k = 0; k < P.delta.size(); ++k) {
      const int64_t j = static_cast<int64_t>(k) / c.Hk % c.Lk;
      const bool dropped = cut && j / dmattn::kGateBlockK % c.gate_keep_every != 0;
      P.delta[k] = nd(rng) * c.gate_std - (dropped ? 6.f : 0.f);
    }
  }
  return P;
}

// ---------------------------------------------------------------------------------------------
// Host reference (double)
// ---------------------------------------------------------------------------------------------
struct Ref {
  std::vector<double> out, lse, dq, dk, dv, dbias, dalpha, ddelta;
  std::vector<char> empty_row;  // [B, H, Lq]
};

Ref Reference(const Problem& P) {
  const Case& c = P.c;
  const AttentionShape& s = P.s;
  const int64_t B = P.B, H = c.H, Hk = c.Hk, Lq = c.Lq, Lk = c.Lk, D = c.D, G = H / Hk;
  Ref R;
  R.out.assign(P.q_elems, 0.0);
  R.lse.assign(B * H * Lq, -INFINITY);
  R.dq.assign(P.q_elems, 0.0);
  R.dk.assign(P.dkv_elems, 0.0);
  R.dv.assign(P.dkv_elems, 0.0);
  R.dbias.assign(P.dbias_elems, 0.0);
  R.dalpha.assign(P.alpha.size(), 0.0);
  R.ddelta.assign(P.delta.size(), 0.0);
  R.empty_row.assign(B * H * Lq, 0);
  std::vector<double> qd(P.q.size()), kd(P.k.size()), vd(P.v.size()), dod(P.dout.size()),
      bd(P.bias.size());
  for (size_t i = 0; i < qd.size(); ++i) qd[i] = P.dt.dec(P.q[i]);
  for (size_t i = 0; i < kd.size(); ++i) kd[i] = P.dt.dec(P.k[i]);
  for (size_t i = 0; i < vd.size(); ++i) vd[i] = P.dt.dec(P.v[i]);
  for (size_t i = 0; i < dod.size(); ++i) dod[i] = P.dt.dec(P.dout[i]);
  for (size_t i = 0; i < bd.size(); ++i) bd[i] = P.dt.dec(P.bias[i]);
  const double scale = s.scale;
  const double cap = c.softcap;

  std::mutex mu;
  auto task = [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H, hk = h / G;
    int64_t qlen = Lq, kvlen = Lk;
    if (s.has_seqlens) {
      const int64_t o = s.seqlens_batch.offset(s.batch, b);
      qlen = std::min<int64_t>(std::max<int32_t>(P.q_lens[o], 0), Lq);
      kvlen = std::min<int64_t>(std::max<int32_t>(P.kv_lens[o], 0), Lk);
    }
    const int64_t kvo = s.kv_offset(b, hk);
    const int64_t mo = s.mask.present ? s.mask.offset(s.batch, b, h) : 0;
    const int64_t bo = s.bias.present ? s.bias.offset(s.batch, b, h) : 0;
    const int64_t dbo = s.bias.present ? s.dbias.offset(s.batch, b, h) : 0;
    const int64_t dkvo = s.dkv_offset(b, hk);
    const int64_t seg_row = s.has_segments ? s.segments_batch.offset(s.batch, b) : 0;
    const int32_t* q_seg = s.has_segments ? P.q_seg.data() + seg_row * Lq : nullptr;
    const int32_t* kv_seg = s.has_segments ? P.kv_seg.data() + seg_row * Lk : nullptr;
    // the forms' arrays of (b, h): position j of the key ranges, i of the row ranges
    const int64_t kro = s.key_ranges.present ? s.key_ranges.offset(s.batch, b, h) : 0;
    const int64_t rro = s.row_ranges.present ? s.row_ranges.offset(s.batch, b, h) : 0;
    const int32_t* blocks = s.block_indices.present
                                ? P.block_indices.data() + s.block_indices.offset(s.batch, b, h)
                                : nullptr;
    // the gate of (b, h): alpha_i, delta_j, and whether the threshold keeps grid block (i, j)
    const float* alpha = s.has_gate ? P.alpha.data() + s.alpha_offset(b, h) : nullptr;
    const float* delta = s.has_gate ? P.delta.data() + s.delta_offset(b, hk) : nullptr;
    auto gate_keeps = [&](int64_t i, int64_t j) {
      if (!(s.gate_cut > -INFINITY)) return true;
      const int64_t i0 = i / dmattn::kGateBlockQ * dmattn::kGateBlockQ;
      const int64_t j0 = j / dmattn::kGateBlockK * dmattn::kGateBlockK;
      double a_lo = INFINITY, a_hi = -INFINITY, d_lo = INFINITY, d_hi = -INFINITY;
      for (int64_t r = i0; r < std::min(i0 + dmattn::kGateBlockQ, Lq); ++r) {
        a_lo = std::min<double>(a_lo, alpha[r * H]);
        a_hi = std::max<double>(a_hi, alpha[r * H]);
      }
      for (int64_t k = j0; k < std::min(j0 + dmattn::kGateBlockK, Lk); ++k) {
        d_lo = std::min<double>(d_lo, delta[k * Hk]);
        d_hi = std::max<double>(d_hi, delta[k * Hk]);
      }
      for (const double corner : {a_lo * d_lo, a_lo * d_hi, a_hi * d_lo, a_hi * d_hi})
        if (!(corner < s.gate_cut)) return true;
      return false;
    };
    std::vector<double> dk_l(Lk * D, 0.0), dv_l(Lk * D, 0.0), dd_l(alpha ? Lk : 0, 0.0);
    std::vector<std::pair<int64_t, double>> db_l;
    std::vector<double> sc(Lk), p(Lk), tt(Lk), dp(Lk);
    std::vector<char> vis(Lk);
    for (int64_t i = 0; i < Lq; ++i) {
      const double* qi = &qd[s.q_offset(b, h) + i * s.q_row_stride()];
      const double* doi = &dod[s.q_offset(b, h) + i * s.q_row_stride()];
      double m = -INFINITY;
      const int32_t* listed = blocks ? blocks + (i / s.block_q) * s.block_slots : nullptr;
      for (int64_t j = 0; j < Lk; ++j) {
        bool v = i < qlen && j < kvlen;
        const int64_t d = j - i;
        if (s.window_left >= 0 && d < s.diagonal_offset - s.window_left) v = false;
        if (s.window_right >= 0 && d > s.diagonal_offset + s.window_right) v = false;
        if (v && s.head_windows != nullptr) {
          const int64_t* w = s.head_windows + 3 * hk;
          const bool in_band = (w[1] < 0 || d >= s.diagonal_offset - w[1]) &&
                               (w[2] < 0 || d <= s.diagonal_offset + w[2]);
          v = j < w[0] || in_band;
        }
        if (v && s.mask.present)
          v = P.mask[mo + i * s.mask.row_stride + j * s.mask.col_stride] != 0;
        if (v && q_seg != nullptr) v = q_seg[i] == kv_seg[j];
        if (v && s.key_ranges.present) v = P.key_start[kro + j] <= i && i < P.key_end[kro + j];
        if (v && s.row_ranges.present) v = P.row_start[rro + i] <= j && j < P.row_end[rro + i];
        if (v && listed != nullptr) {  // entries naming no block never equal j's block
          v = std::find(listed, listed + s.block_slots, j / s.block_k) != listed + s.block_slots;
        }
        if (v && alpha != nullptr) v = gate_keeps(i, j);
        vis[j] = v;
        if (!v) continue;
        const double* kj = &kd[kvo + j * s.kv_row_stride()];
        double dot = 0;
        for (int64_t e = 0; e < D; ++e) dot += qi[e] * kj[e];
        double z = scale * dot;
        if (s.bias.present) z += bd[bo + i * s.bias.row_stride + j * s.bias.col_stride];
        if (alpha != nullptr) {  // + logsigmoid(alpha_i delta_j)
          const double x = static_cast<double>(alpha[i * H]) * delta[j * Hk];
          z += std::min(x, 0.0) - std::log1p(std::exp(-std::fabs(x)));
        }
        if (cap > 0) {
          tt[j] = std::tanh(z / cap);
          z = cap * tt[j];
        }
        sc[j] = z;
        m = std::max(m, z);
      }
      const int64_t li = s.lse_offset(b, h) + i;
      if (m == -INFINITY) {
        R.empty_row[li] = 1;
        continue;  // out 0, lse -inf, no gradient
      }
      double l = 0;
      for (int64_t j = 0; j < Lk; ++j) {
        p[j] = vis[j] ? std::exp(sc[j] - m) : 0.0;
        l += p[j];
      }
      R.lse[li] = m + std::log(l);
      double* oi = &R.out[s.q_offset(b, h) + i * s.q_row_stride()];
      for (int64_t j = 0; j < Lk; ++j) {
        if (!vis[j]) continue;
        p[j] /= l;
        const double* vj = &vd[kvo + j * s.kv_row_stride()];
        for (int64_t e = 0; e < D; ++e) oi[e] += p[j] * vj[e];
      }
      // backward
      double Di = 0;
      for (int64_t j = 0; j < Lk; ++j) {
        dp[j] = 0;
        if (!vis[j]) continue;
        const double* vj = &vd[kvo + j * s.kv_row_stride()];
        for (int64_t e = 0; e < D; ++e) dp[j] += doi[e] * vj[e];
        Di += p[j] * dp[j];
      }
      Di -= P.dlse[li];
      double* dqi = &R.dq[s.q_offset(b, h) + i * s.q_row_stride()];
      for (int64_t j = 0; j < Lk; ++j) {
        if (!vis[j]) continue;
        double ds = p[j] * (dp[j] - Di);
        if (cap > 0) ds *= (1 - tt[j] * tt[j]);
        const double* kj = &kd[kvo + j * s.kv_row_stride()];
        for (int64_t e = 0; e < D; ++e) {
          dqi[e] += scale * ds * kj[e];
          dk_l[j * D + e] += scale * ds * qi[e];
          dv_l[j * D + e] += p[j] * doi[e];
        }
        if (s.bias.present)
          db_l.push_back({dbo + i * s.dbias.row_stride + j * s.dbias.col_stride, ds});
        if (alpha != nullptr) {  // d logsigmoid(x) = sigmoid(-x) dx, x = alpha_i delta_j
          const double x = static_cast<double>(alpha[i * H]) * delta[j * Hk];
          const double gds = ds / (1.0 + std::exp(x));
          R.dalpha[s.alpha_offset(b, h) + i * H] += gds * delta[j * Hk];  // row (b, h, i): this task's
          dd_l[j] += gds * alpha[i * H];
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    for (int64_t j = 0; j < Lk; ++j)
      for (int64_t e = 0; e < D; ++e) {
        R.dk[dkvo + j * s.kv_row_stride() + e] += dk_l[j * D + e];
        R.dv[dkvo + j * s.kv_row_stride() + e] += dv_l[j * D + e];
      }
    for (auto& x : db_l) R.dbias[x.first] += x.second;
    for (int64_t j = 0; j < static_cast<int64_t>(dd_l.size()); ++j)
      R.ddelta[s.delta_offset(b, hk) + j * Hk] += dd_l[j];
  };
  const int64_t tasks = B * H;
  const int nth = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> th;
  std::atomic<int64_t> next{0};
  for (int t = 0; t < nth; ++t)
    th.emplace_back([&] {
      for (int64_t i = next++; i < tasks; i = next++) task(i);
    });
  for (auto& t : th) t.join();
  return R;
}

// ---------------------------------------------------------------------------------------------
// Device run
// ---------------------------------------------------------------------------------------------
template <typename T>
T* Upload(const std::vector<T>& h) {
  if (h.empty()) return nullptr;
  T* d;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
void* Poisoned(size_t bytes) {
  void* d;
  CK(cudaMalloc(&d, std::max<size_t>(bytes, 16)));
  CK(cudaMemset(d, 0xff, std::max<size_t>(bytes, 16)));  // NaN in bf16/fp16/fp32
  return d;
}

struct DeviceOut {
  std::vector<uint16_t> out, dq, dk, dv, dbias;
  std::vector<float> lse, dalpha, ddelta;
};

struct Err {
  double rel = 0;
  bool nan = false;
};

Err Worse(const Err& a, const Err& b) { return {std::max(a.rel, b.rel), a.nan || b.nan}; }

Err Compare16(const std::vector<uint16_t>& x, const std::vector<double>& ref, const Dtype& dt) {
  Err e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = dt.dec(x[i]);
    if (!std::isfinite(v)) e.nan = true;
    num += (v - ref[i]) * (v - ref[i]);
    den += ref[i] * ref[i];
  }
  e.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

// fp32 results (the gate's gradients): relative RMS error, as Compare16.
Err Compare32(const std::vector<float>& x, const std::vector<double>& ref) {
  Err e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(x[i])) e.nan = true;
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  e.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

// lse: -inf exactly where the reference is -inf, max abs error elsewhere.
Err CompareLse(const std::vector<float>& x, const std::vector<double>& ref) {
  Err e;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (!(std::isinf(x[i]) && x[i] < 0)) e.nan = true;
    } else {
      if (!std::isfinite(x[i])) e.nan = true;
      e.rel = std::max(e.rel, std::fabs(x[i] - ref[i]));
    }
  }
  return e;
}

bool DtypeCompiled(bool bf16) {
#if defined(DMATTN_ENABLE_BF16)
  if (bf16) return true;
#endif
#if defined(DMATTN_ENABLE_FP16)
  if (!bf16) return true;
#endif
  return false;
}

struct Buffers {
  uint16_t *q, *k, *v, *bias, *dout;
  uint8_t *mask, *mask_map, *mask_bits;
  float* dlse;
  int32_t *ql, *kl;
  int32_t *qs, *ks;  // segment ids
  int32_t *key_start, *key_end, *row_start, *row_end, *block_indices;  // the O(L) mask forms
  float *alpha, *delta;  // the gate
  int32_t* page_table = nullptr;  // k and v as a paged cache (PagedMatchesContiguous)
};

struct FwdOut {
  void* out = nullptr;  // device, kept for the backward
  float* lse = nullptr;
};

// A Hopper GPU, where the dispatcher may pick either forward generation.
bool HopperGpu() {
  int dev = 0, major = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major == 9;
}

// Mean milliseconds of `reps` back-to-back launches by `launch` (CUDA events on stream 0).
template <typename Launch>
float MeanMs(Launch launch, int reps) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) launch();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms / reps;
}

// `workspace`: give the forward its workspace (without it, it runs unsplit and in plain order;
// index masks still get their summaries).
FwdOut RunForwardDevice(const Problem& P, const Buffers& in, DeviceOut* r, float* ms, int reps,
                        bool workspace = true) {
  const AttentionShape& s = P.s;
  FwdOut f;
  f.out = Poisoned(P.q_elems * 2);
  f.lse = static_cast<float*>(Poisoned(P.B * s.num_heads * s.seqlen_q * 4));
  ForwardArgs fa;
  fa.q = in.q;
  fa.k = in.k;
  fa.v = in.v;
  fa.mask = reinterpret_cast<const bool*>(in.mask);
  fa.mask_map = in.mask_map;
  fa.mask_bits = in.mask_bits;
  fa.bias = in.bias;
  fa.q_lens = in.ql;
  fa.kv_lens = in.kl;
  fa.q_segments = in.qs;
  fa.kv_segments = in.ks;
  fa.key_start = in.key_start;
  fa.key_end = in.key_end;
  fa.row_start = in.row_start;
  fa.row_end = in.row_end;
  fa.block_indices = in.block_indices;
  fa.alpha = in.alpha;
  fa.delta = in.delta;
  fa.page_table = in.page_table;
  fa.out = f.out;
  fa.lse = f.lse;
  const int64_t workspace_bytes = workspace ? dmattn::cuda::ForwardWorkspaceBytes(s)
                                            : dmattn::cuda::IndexMaskBytes(s);
  fa.workspace[0] = workspace_bytes > 0 ? Poisoned(workspace_bytes) : nullptr;
  fa.workspace_bytes[0] = workspace_bytes;
  CK(dmattn::cuda::Forward(s, fa, 0));
  CK(cudaDeviceSynchronize());
  if (ms) *ms = MeanMs([&] { CK(dmattn::cuda::Forward(s, fa, 0)); }, reps);
  for (void* w : fa.workspace) {
    if (w) CK(cudaFree(w));
  }
  r->out = Download(static_cast<uint16_t*>(f.out), P.q_elems);
  r->lse = Download(f.lse, P.B * s.num_heads * s.seqlen_q);
  return f;
}

// `order`: give the backward room for its key-block order (one byte short of it, it runs them in
// plain order; the dbias accumulator after the order still fits).
void RunBackwardDevice(const Problem& P, const Buffers& in, const FwdOut& f, DeviceOut* r,
                       float* ms, int reps, bool order = true) {
  const AttentionShape& s = P.s;
  void* dq = Poisoned(P.q_elems * 2);
  void* dk = Poisoned(P.dkv_elems * 2);
  void* dv = Poisoned(P.dkv_elems * 2);
  void* dbias = s.bias.present && P.c.dbias ? Poisoned(P.dbias_elems * 2) : nullptr;
  float* sd = static_cast<float*>(Poisoned(P.B * s.num_heads * s.seqlen_q * 4));
  void* ws0 = Poisoned(P.q_elems * 4);
  const int64_t ws1_bytes = dmattn::cuda::BackwardWorkspaceBytes(s) - (order ? 0 : 1);
  void* ws1 = Poisoned(ws1_bytes);
  BackwardArgs ba;
  ba.q = in.q;
  ba.k = in.k;
  ba.v = in.v;
  ba.out = f.out;
  ba.dout = in.dout;
  ba.lse = f.lse;
  ba.dlse = in.dlse;
  ba.mask = reinterpret_cast<const bool*>(in.mask);
  ba.mask_map = in.mask_map;
  ba.mask_bits = in.mask_bits;
  ba.bias = in.bias;
  ba.q_lens = in.ql;
  ba.kv_lens = in.kl;
  ba.q_segments = in.qs;
  ba.kv_segments = in.ks;
  ba.key_start = in.key_start;
  ba.key_end = in.key_end;
  ba.row_start = in.row_start;
  ba.row_end = in.row_end;
  ba.block_indices = in.block_indices;
  ba.alpha = in.alpha;
  ba.delta = in.delta;
  float* dalpha = P.alpha.empty() ? nullptr : static_cast<float*>(Poisoned(P.alpha.size() * 4));
  float* ddelta = P.delta.empty() ? nullptr : static_cast<float*>(Poisoned(P.delta.size() * 4));
  ba.dalpha = dalpha;
  ba.ddelta = ddelta;
  ba.dq = dq;
  ba.dk = dk;
  ba.dv = dv;
  ba.dbias = dbias;
  ba.softmax_d = sd;
  ba.workspace[0] = ws0;
  ba.workspace[1] = ws1;
  ba.workspace_bytes[1] = ws1_bytes;
  CK(dmattn::cuda::Backward(s, ba, 0));
  CK(cudaDeviceSynchronize());
  if (ms) *ms = MeanMs([&] { CK(dmattn::cuda::Backward(s, ba, 0)); }, reps);
  r->dq = Download(static_cast<uint16_t*>(dq), P.q_elems);
  r->dk = Download(static_cast<uint16_t*>(dk), P.dkv_elems);
  r->dv = Download(static_cast<uint16_t*>(dv), P.dkv_elems);
  if (dbias) r->dbias = Download(static_cast<uint16_t*>(dbias), P.dbias_elems);
  if (dalpha) r->dalpha = Download(dalpha, P.alpha.size());
  if (ddelta) r->ddelta = Download(ddelta, P.delta.size());
  for (void* p : {dq, dk, dv, dbias, static_cast<void*>(sd), ws0, ws1, static_cast<void*>(dalpha),
                  static_cast<void*>(ddelta)})
    if (p) CK(cudaFree(p));
}

void FreeFwd(FwdOut& f) {
  CK(cudaFree(f.out));
  CK(cudaFree(f.lse));
}

// Worst element of a 16-bit tensor against the reference, for failure reports.
void Worst(const char* what, const std::vector<uint16_t>& x, const std::vector<double>& ref,
           const Dtype& dt, int64_t row_elems, int64_t heads, int64_t D) {
  double worst = -1;
  size_t wi = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = dt.dec(x[i]);
    const double e = std::isfinite(v) ? std::fabs(v - ref[i]) : INFINITY;
    if (e > worst) {
      worst = e;
      wi = i;
    }
  }
  if (ref.empty()) return;
  const int64_t row = static_cast<int64_t>(wi) / row_elems;
  const int64_t rem = static_cast<int64_t>(wi) % row_elems;
  std::printf("    worst %-5s at flat %zu (outer row %lld, head %lld, col %lld): got %.5g ref %.5g\n",
              what, wi, static_cast<long long>(row), static_cast<long long>(rem / D),
              static_cast<long long>(rem % D), dt.dec(x[wi]), ref[wi]);
}

// The mask's block map and bits, as the FFI layer's mask_map call makes them (poisoned first, so
// that a byte the pass leaves unwritten shows; null without a mask).
void BuildMaskMap(const AttentionShape& s, const uint8_t* mask, uint8_t** cells, uint8_t** bits) {
  *cells = *bits = nullptr;
  if (mask == nullptr) return;
  const int64_t rows = s.mask.row_stride != 0 ? s.seqlen_q : 1;
  const int64_t cols = s.mask.col_stride != 0 ? s.seqlen_k : 1;
  const bool full = rows == s.seqlen_q && cols == s.seqlen_k;
  const int64_t entries = s.mask.num_elements / std::max<int64_t>(rows * cols, 1);
  const int64_t cell = dmattn::kMaskMapCell;
  *cells = static_cast<uint8_t*>(
      Poisoned(entries * ((rows + cell - 1) / cell) * ((cols + cell - 1) / cell)));
  *bits = static_cast<uint8_t*>(Poisoned(entries * rows * dmattn::MaskBitsRowBytes(cols)));
  CK(dmattn::cuda::BuildMaskBlockMap(reinterpret_cast<const bool*>(mask), entries, rows, cols,
                                     full ? s : AttentionShape{}, *cells, *bits, 0));
}

Buffers UploadInputs(const Problem& P) {
  Buffers b;
  b.q = Upload(P.q);
  b.k = Upload(P.k);
  b.v = Upload(P.v);
  b.bias = Upload(P.bias);
  b.dout = Upload(P.dout);
  b.mask = Upload(P.mask);
  BuildMaskMap(P.s, b.mask, &b.mask_map, &b.mask_bits);
  b.dlse = Upload(P.dlse);
  b.ql = Upload(P.q_lens);
  b.kl = Upload(P.kv_lens);
  b.qs = Upload(P.q_seg);
  b.ks = Upload(P.kv_seg);
  b.key_start = Upload(P.key_start);
  b.key_end = Upload(P.key_end);
  b.row_start = Upload(P.row_start);
  b.row_end = Upload(P.row_end);
  b.block_indices = Upload(P.block_indices);
  b.alpha = Upload(P.alpha);
  b.delta = Upload(P.delta);
  return b;
}
void FreeInputs(Buffers& b) {
  for (void* p : {static_cast<void*>(b.q), static_cast<void*>(b.k), static_cast<void*>(b.v),
                  static_cast<void*>(b.bias), static_cast<void*>(b.dout),
                  static_cast<void*>(b.mask), static_cast<void*>(b.mask_map),
                  static_cast<void*>(b.mask_bits),
                  static_cast<void*>(b.dlse),
                  static_cast<void*>(b.ql), static_cast<void*>(b.kl),
                  static_cast<void*>(b.qs), static_cast<void*>(b.ks),
                  static_cast<void*>(b.key_start), static_cast<void*>(b.key_end),
                  static_cast<void*>(b.row_start), static_cast<void*>(b.row_end),
                  static_cast<void*>(b.block_indices), static_cast<void*>(b.alpha),
                  static_cast<void*>(b.delta)})
    if (p) CK(cudaFree(p));
}

// The case's k and v as a paged cache (pages of kMinPageSize keys, scattered in a pool with
// two spare pages, the last page of a sequence partly used) through the decode forward: its out
// and lse must be bit for bit `contiguous`'s (the same tiles in the same order).
bool PagedMatchesContiguous(const Problem& P, const Buffers& in, const DeviceOut& contiguous) {
  const AttentionShape& s = P.s;
  const int64_t ps = dmattn::kMinPageSize, row = s.kv_row_stride();
  const int64_t max_pages = (s.seqlen_k + ps - 1) / ps, num_pages = P.B * max_pages + 2;
  std::vector<int32_t> order(num_pages);
  for (int64_t i = 0; i < num_pages; ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  std::vector<int32_t> table(order.begin(), order.begin() + P.B * max_pages);
  std::vector<uint16_t> k(num_pages * ps * row), v(num_pages * ps * row);
  for (int64_t b = 0; b < P.B; ++b) {
    for (int64_t j = 0; j < s.seqlen_k; ++j) {
      const int64_t from = s.kv_offset(b, 0) + j * row;
      const int64_t to = (table[b * max_pages + j / ps] * ps + j % ps) * row;
      std::copy_n(P.k.begin() + from, row, k.begin() + to);
      std::copy_n(P.v.begin() + from, row, v.begin() + to);
    }
  }
  Problem paged = P;
  paged.s.kv_batch = BatchStrides{};
  paged.s.pages.page_size = ps;
  while ((int64_t{1} << paged.s.pages.page_shift) < ps) ++paged.s.pages.page_shift;
  paged.s.pages.num_pages = num_pages;
  paged.s.pages.max_pages = max_pages;
  paged.s.pages.table_batch = Strides(P.c.batch, max_pages);
  Buffers pin = in;
  pin.k = Upload(k);
  pin.v = Upload(v);
  pin.page_table = Upload(table);
  DeviceOut o;
  FwdOut f = RunForwardDevice(paged, pin, &o, nullptr, 0);
  FreeFwd(f);
  for (void* d : {static_cast<void*>(pin.k), static_cast<void*>(pin.v),
                  static_cast<void*>(pin.page_table)}) {
    CK(cudaFree(d));
  }
  return o.out == contiguous.out && o.lse == contiguous.lse;
}

OperandSpec Op(std::vector<int64_t> batch, int64_t heads, bool rows, bool cols) {
  OperandSpec o;
  o.present = true;
  o.batch = std::move(batch);
  o.heads = heads;
  o.rows = rows;
  o.cols = cols;
  return o;
}

// An O(L) mask form over `batch` (full or 1 per dim) and `heads` (H, Hk or 1).
OperandSpec Form(std::vector<int64_t> batch, int64_t heads) {
  return Op(std::move(batch), heads, false, false);
}

std::vector<Case> AllCases() {
  std::vector<Case> v;
  auto add = [&](Case c) { v.push_back(c); };
  {
    Case c; c.name = "dense_d64"; c.batch = {2}; c.H = 4; c.Hk = 4; c.Lq = 128; c.Lk = 128;
    c.D = 64; add(c);
  }
  {
    Case c; c.name = "irregular_q17_k129_d96_mask_bias"; c.batch = {1}; c.H = 4; c.Hk = 2;
    c.Lq = 17; c.Lk = 129; c.D = 96;
    c.mask = Op({1}, 4, true, true); c.bias = Op({1}, 4, true, true); add(c);
  }
  {
    Case c; c.name = "causal_q100_k300_d128_bias"; c.H = 2; c.Hk = 2; c.Lq = 100; c.Lk = 300;
    c.D = 128; c.causal = true; c.bias = Op({1}, 2, true, true); c.dlse = true; add(c);
  }
  {
    Case c; c.name = "causal_q300_k100_d64_bcastmask"; c.H = 2; c.Hk = 1; c.Lq = 300;
    c.Lk = 100; c.D = 64; c.causal = true; c.mask = Op({1}, 1, true, true); add(c);
  }
  {
    Case c; c.name = "gqa8_2_mask11LL_bias_perkey_d128"; c.batch = {2}; c.H = 8; c.Hk = 2;
    c.Lq = 256; c.Lk = 256; c.D = 128; c.mask = Op({1}, 1, true, true);
    c.bias = Op({2}, 2, false, true); add(c);
  }
  {
    Case c; c.name = "masked_rows_tiles_d64"; c.H = 2; c.Hk = 2; c.Lq = 200; c.Lk = 300;
    c.D = 64; c.mask = Op({1}, 2, true, true); c.mask_holes = true; c.mask_density = 0.5f;
    c.bias = Op({1}, 2, true, true); add(c);
  }
  {
    Case c; c.name = "seqlens_d32"; c.batch = {3}; c.H = 2; c.Hk = 1; c.Lq = 150; c.Lk = 170;
    c.D = 32; c.seqlens = true; c.q_lens = {150, 50, 0}; c.kv_lens = {167, 70, 10};
    c.bias = Op({3}, 1, true, true); c.dlse = true; add(c);
  }
  {
    Case c; c.name = "softcap_d256_bias"; c.H = 2; c.Hk = 2; c.Lq = 130; c.Lk = 130; c.D = 256;
    c.softcap = 5.f; c.qk_std = 1.5f; c.bias = Op({1}, 2, true, true); add(c);
  }
  {
    Case c; c.name = "window40_10_d192_bias1row"; c.H = 2; c.Hk = 2; c.Lq = 200; c.Lk = 200;
    c.D = 192; c.window_left = 40; c.window_right = 10; c.bias = Op({1}, 1, false, true);
    add(c);
  }
  {
    Case c; c.name = "kvbatch_bcast_d64_atomic_bias"; c.batch = {2, 2}; c.kv_batch = {1, 2};
    c.H = 4; c.Hk = 2; c.Lq = 96; c.Lk = 96; c.D = 64; c.mask = Op({1, 2}, 2, true, true);
    c.bias = Op({2, 1}, 4, true, true); add(c);
  }
  {
    Case c; c.name = "bias_colbcast_d64"; c.H = 2; c.Hk = 2; c.Lq = 70; c.Lk = 150; c.D = 64;
    c.bias = Op({1}, 2, true, false); c.dlse = true; add(c);
  }
  {
    Case c; c.name = "deterministic_gqa_d128"; c.batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 190;
    c.Lk = 230; c.D = 128; c.mask = Op({2}, 2, true, true); c.mask_holes = true;
    c.bias = Op({2}, 2, false, true); c.deterministic = true; add(c);
  }
  {
    // the warp-specialised Hopper backward's dQ turns: a window with GQA and lengths (query
    // blocks that only some key blocks see), and MQA, causal, Lq > Lk
    Case c; c.name = "deterministic_q1000_k1030_d64_window_gqa"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 1000; c.Lk = 1030; c.D = 64; c.window_left = 300; c.window_right = 40;
    c.seqlens = true; c.q_lens = {1000, 417}; c.kv_lens = {1030, 600}; c.deterministic = true;
    add(c);
    c = Case(); c.name = "deterministic_q900_k700_d128_causal_mqa"; c.batch = {2}; c.H = 4;
    c.Hk = 1; c.Lq = 900; c.Lk = 700; c.D = 128; c.causal = true; c.deterministic = true;
    add(c);
  }
  {
    // mask rows on 16 bytes, a partial last cell and a partial group of cells (mask pass)
    Case c; c.name = "causal_mask_only_d128_q200_k336"; c.H = 2; c.Hk = 2; c.Lq = 200;
    c.Lk = 336; c.D = 128; c.causal = true; c.mask = Op({1}, 2, true, true); c.mask_holes = true;
    add(c);
  }
  {
    Case c; c.name = "fp16_causal_d128_mask_bias"; c.bf16 = false; c.H = 4; c.Hk = 4;
    c.Lq = 257; c.Lk = 257; c.D = 128; c.causal = true; c.mask = Op({1}, 4, true, true);
    c.bias = Op({1}, 4, true, true); add(c);
  }
  {
    Case c; c.name = "fp16_mqa_d64_k1000"; c.bf16 = false; c.H = 8; c.Hk = 1; c.Lq = 65;
    c.Lk = 1000; c.D = 64; c.mask = Op({1}, 1, true, true); c.bias = Op({1}, 8, false, true);
    add(c);
  }
  {
    Case c; c.name = "causal_1000_d128_mask_bias"; c.H = 2; c.Hk = 1; c.Lq = 1000; c.Lk = 1000;
    c.D = 128; c.causal = true; c.mask = Op({1}, 2, true, true); c.mask_density = 0.3f;
    c.mask_holes = true; c.bias = Op({1}, 2, true, true); c.dlse = true; add(c);
  }
  {
    Case c; c.name = "d32_bias_vec"; c.H = 2; c.Hk = 2; c.Lq = 64; c.Lk = 64; c.D = 32;
    c.bias = Op({1}, 2, true, true); c.mask = Op({1}, 2, true, true); add(c);
  }
  {
    Case c; c.name = "mqa4_d256_mask"; c.H = 4; c.Hk = 1; c.Lq = 200; c.Lk = 200; c.D = 256;
    c.mask = Op({1}, 1, true, true); c.mask_holes = true; add(c);
  }
  {
    Case c; c.name = "decode_q1_k1000_d128"; c.H = 8; c.Hk = 2; c.Lq = 1; c.Lk = 1000;
    c.D = 128; c.mask = Op({1}, 2, true, true); c.bias = Op({1}, 2, true, true); add(c);
  }
  {
    Case c; c.name = "all_masked_d64"; c.H = 2; c.Hk = 2; c.Lq = 70; c.Lk = 90; c.D = 64;
    c.mask = Op({1}, 2, true, true); c.mask_density = 0.f; c.bias = Op({1}, 2, true, true);
    add(c);
  }
  {
    Case c; c.name = "fp16_d96_window_seqlens"; c.bf16 = false; c.batch = {2}; c.H = 2;
    c.Hk = 2; c.Lq = 140; c.Lk = 150; c.D = 96; c.window_left = 30; c.window_right = 30;
    c.seqlens = true; c.q_lens = {140, 77}; c.kv_lens = {150, 33};
    c.mask = Op({2}, 2, true, true); add(c);
  }
  {
    Case c; c.name = "fp16_d192_bias_bcast_heads_rows"; c.bf16 = false; c.batch = {2};
    c.H = 4; c.Hk = 4; c.Lq = 100; c.Lk = 128; c.D = 192; c.bias = Op({1}, 1, true, true);
    add(c);
  }
  {
    Case c; c.name = "fp16_d32_d256like_softcap"; c.bf16 = false; c.H = 2; c.Hk = 1;
    c.Lq = 129; c.Lk = 64; c.D = 32; c.softcap = 3.f; c.qk_std = 2.f; c.causal = true;
    c.bias = Op({1}, 1, false, true); add(c);
  }
  {
    // vmap layout: k, v and bias read with stride 0 over the batch, their gradients full-size
    Case c; c.name = "vmap_grads_full_d64"; c.batch = {2}; c.kv_batch = {1}; c.dkv_batch = {2};
    c.H = 4; c.Hk = 2; c.Lq = 80; c.Lk = 144; c.D = 64; c.bias = Op({1}, 4, true, true);
    c.dbias_batch = {2}; c.mask = Op({1}, 2, true, true); add(c);
  }
  {
    // the Hopper forward's mask / bias tiles (key lengths of whole 16-byte mask rows): full
    // mask with holes and bias, causal; a 10 % block mask with a per-key bias and softcap; a
    // mask broadcast over queries with a per-head bias, GQA and sequence lengths
    Case c; c.name = "hopper_mask_bias_d128_q300_k512"; c.batch = {2}; c.H = 4; c.Hk = 2;
    c.Lq = 300; c.Lk = 512; c.D = 128; c.causal = true; c.mask = Op({2}, 4, true, true);
    c.mask_holes = true; c.bias = Op({2}, 4, true, true); add(c);
  }
  {
    Case c; c.name = "hopper_blocks_perkey_d64_softcap"; c.batch = {2}; c.H = 4; c.Hk = 1;
    c.Lq = 700; c.Lk = 1024; c.D = 64; c.mask = Op({1}, 1, true, true); c.block_density = 0.3f;
    c.bias = Op({2}, 1, false, true); c.softcap = 15.f; add(c);
  }
  {
    // a full bias and mask with softcap: the mask applies after the softcap, on the consumers
    // (not written into the bias tile by the mask warps)
    Case c; c.name = "hopper_mask_bias_softcap_d128_q200_k384"; c.H = 2; c.Hk = 2; c.Lq = 200;
    c.Lk = 384; c.D = 128; c.mask = Op({1}, 2, true, true); c.mask_density = 0.5f;
    c.bias = Op({1}, 2, true, true); c.softcap = 8.f; c.qk_std = 1.5f; add(c);
  }
  {
    Case c; c.name = "fp16_hopper_rowmask_bias_d128_seqlens"; c.bf16 = false; c.batch = {2};
    c.H = 8; c.Hk = 2; c.Lq = 200; c.Lk = 384; c.D = 128; c.mask = Op({2}, 1, false, true);
    c.bias = Op({1}, 8, true, true); c.seqlens = true; c.q_lens = {200, 150};
    c.kv_lens = {384, 250}; add(c);
  }
  {
    Case c; c.name = "vmap_perkey_bias_d128"; c.batch = {3}; c.kv_batch = {1}; c.dkv_batch = {3};
    c.H = 4; c.Hk = 1; c.Lq = 64; c.Lk = 200; c.D = 128; c.bias = Op({1}, 1, false, true);
    c.dbias_batch = {3}; c.causal = true; add(c);
  }
  {
    Case c; c.name = "gqa_bcast_kv_summed_d128"; c.batch = {2, 3}; c.kv_batch = {2, 1};
    c.H = 4; c.Hk = 2; c.Lq = 50; c.Lk = 70; c.D = 128; c.bias = Op({2, 1}, 2, false, true);
    c.deterministic = true; add(c);
  }
  // multi-block shapes for the pipelined backward (two Q/dO stages) and the wide tiles
  {
    Case c; c.name = "dense_gqa_d128_q300_k520"; c.batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 300;
    c.Lk = 520; c.D = 128; add(c);
  }
  {
    Case c; c.name = "causal_d64_q333_k400"; c.H = 2; c.Hk = 1; c.Lq = 333; c.Lk = 400;
    c.D = 64; c.causal = true; c.dlse = true; add(c);
  }
  {
    Case c; c.name = "dense_gqa_d256_q300_k1000"; c.H = 4; c.Hk = 2; c.Lq = 300; c.Lk = 1000;
    c.D = 256; add(c);
    c.name = "causal_d256_q333_k400"; c.Lq = 333; c.Lk = 400; c.causal = true; add(c);
  }
  {
    Case c; c.name = "softcap_d128_mask_bias_q200_k260"; c.H = 2; c.Hk = 1; c.Lq = 200;
    c.Lk = 260; c.D = 128; c.softcap = 5.f; c.qk_std = 1.5f; c.mask = Op({1}, 2, true, true);
    c.mask_holes = true; c.bias = Op({1}, 2, true, true); add(c);
  }
  {
    Case c; c.name = "perkey_bias_gqa_d64_q300"; c.H = 4; c.Hk = 2; c.Lq = 300; c.Lk = 300;
    c.D = 64; c.bias = Op({1}, 4, false, true); add(c);
  }
  {
    Case c; c.name = "split_q1_k4000_d64_causal_offset"; c.batch = {3}; c.H = 8; c.Hk = 2;
    c.Lq = 1; c.Lk = 4000; c.D = 64; c.causal = true; c.mask = Op({3}, 2, true, true);
    c.mask_holes = true; add(c);
  }
  {
    Case c; c.name = "split_q300_k3000_d256_softcap"; c.batch = {1}; c.H = 2; c.Hk = 2;
    c.Lq = 300; c.Lk = 3000; c.D = 256; c.softcap = 30.f; c.bias = Op({1}, 2, true, true);
    add(c);
  }
  {
    // more query blocks than two waves, 33 key tiles each: the forward ranks them by their
    // non-empty tiles; more key blocks than one wave, 72 query tiles each: so does the backward
    Case c; c.name = "ordered_q1100_k4100_d128_mask_seqlens"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 1100; c.Lk = 4100; c.D = 128; c.causal = true; c.seqlens = true;
    c.q_lens = {1100, 640}; c.kv_lens = {4100, 3300}; c.mask = Op({2}, 1, true, true);
    c.block_density = 0.3f; c.mask_holes = true; add(c);
  }
  {
    // more key blocks than one wave of backward CTAs, 36 query tiles each: the backward's order
    Case c; c.name = "ordered_bwd_q1100_k1100_d128_mask_bias"; c.batch = {2}; c.H = 16;
    c.Hk = 8; c.Lq = 1100; c.Lk = 1100; c.D = 128; c.causal = true; c.seqlens = true;
    c.q_lens = {1100, 911}; c.kv_lens = {1100, 830}; c.mask = Op({2}, 8, true, true);
    c.mask_holes = true; c.block_density = 0.5f; c.bias = Op({2}, 16, true, true); add(c);
  }
  {
    Case c; c.name = "window_seqlens_d128"; c.batch = {2}; c.H = 2; c.Hk = 2; c.Lq = 400;
    c.Lk = 400; c.D = 128; c.window_left = 100; c.window_right = 20; c.seqlens = true;
    c.q_lens = {400, 150}; c.kv_lens = {380, 222}; add(c);
  }
  // segment ids: packed documents (tiles skipped, single-id tiles unchecked, the rest compared
  // per score), ids at random per position (nothing skipped), with every other feature
  {
    Case c; c.name = "seg_packed_causal_q1100_k1100_d128"; c.batch = {2}; c.H = 4; c.Hk = 2;
    c.Lq = 1100; c.Lk = 1100; c.D = 128; c.causal = true; c.seg_docs = 6; c.dlse = true; add(c);
  }
  {
    Case c; c.name = "seg_packed_q17_k129_d64"; c.H = 2; c.Hk = 1; c.Lq = 17; c.Lk = 129;
    c.D = 64; c.seg_docs = 3; add(c);
  }
  {
    Case c; c.name = "seg_packed_causal_q300_k4100_d128_mask_bias"; c.H = 4; c.Hk = 2;
    c.Lq = 300; c.Lk = 4100; c.D = 128; c.causal = true; c.seg_docs = 9;
    c.mask = Op({1}, 2, true, true); c.mask_holes = true; c.bias = Op({1}, 4, true, true);
    add(c);
  }
  {
    Case c; c.name = "seg_random_q333_k520_d64_bias"; c.batch = {2}; c.H = 4; c.Hk = 2;
    c.Lq = 333; c.Lk = 520; c.D = 64; c.seg_docs = 3; c.seg_random = true;
    c.bias = Op({2}, 4, true, true); add(c);
  }
  {
    Case c; c.name = "seg_random_gqa_q700_k900_d128"; c.batch = {2}; c.H = 8; c.Hk = 2;
    c.Lq = 700; c.Lk = 900; c.D = 128; c.seg_docs = 4; c.seg_random = true; add(c);
    c = Case(); c.name = "seg_shared_causal_q1000_k1000_d64"; c.batch = {3}; c.H = 4; c.Hk = 4;
    c.Lq = 1000; c.Lk = 1000; c.D = 64; c.causal = true; c.seg_docs = 5; c.seg_shared = true;
    add(c);
  }
  {
    Case c; c.name = "seg_random_causal_q700_k700_d128_mask"; c.H = 2; c.Hk = 2; c.Lq = 700;
    c.Lk = 700; c.D = 128; c.causal = true; c.seg_docs = 2; c.seg_random = true;
    c.mask = Op({1}, 2, true, true); add(c);
  }
  {
    Case c; c.name = "seg_shared_gqa_seqlens_d96_perkey_bias"; c.batch = {3}; c.H = 8; c.Hk = 2;
    c.Lq = 257; c.Lk = 390; c.D = 96; c.seg_docs = 5; c.seg_shared = true; c.seqlens = true;
    c.q_lens = {257, 100, 0}; c.kv_lens = {390, 129, 50}; c.bias = Op({3}, 8, false, true);
    c.dlse = true; add(c);
  }
  {
    // A bias broadcast over keys has dbias_i = sum_j dS_ij, which is dlse_i exactly without a
    // softcap (softmax ignores a per-row shift) and, with a softcap, that plus sum_j dS_ij t_ij^2
    // (t = tanh(s / softcap)). With softcap 10 and no lse cotangent that sum was ~1/150 of the
    // |dS| it sums, and the bf16 P, out and 1 - t^2 of the kernels' backward (as designed) put
    // dbias 11 % off (float64 emulation of those roundings on this case's inputs: 11.3 %; 7 %
    // without segment ids). A cotangent for lse (as the Python suite always has) and softcap 2
    // keep the sum well above the rounding: 0.8 % emulated, bias_colbcast_d64's level.
    Case c; c.name = "seg_orphans_d128_bias_colbcast_softcap"; c.batch = {2}; c.H = 2;
    c.Hk = 2; c.Lq = 200; c.Lk = 260; c.D = 128; c.seg_docs = 4; c.seg_orphans = true;
    c.softcap = 2.f; c.dlse = true; c.bias = Op({1}, 2, true, false); add(c);
  }
  {
    Case c; c.name = "seg_fp16_window_d32_bias1row"; c.bf16 = false; c.batch = {2}; c.H = 4;
    c.Hk = 4; c.Lq = 400; c.Lk = 300; c.D = 32; c.window_left = 50; c.window_right = 30;
    c.seg_docs = 7; c.bias = Op({2}, 1, false, true); add(c);
  }
  {
    Case c; c.name = "seg_deterministic_d128_mask_bias"; c.batch = {2}; c.H = 4; c.Hk = 2;
    c.Lq = 190; c.Lk = 230; c.D = 128; c.seg_docs = 4; c.deterministic = true;
    c.mask = Op({2}, 2, true, true); c.mask_holes = true; c.bias = Op({2}, 2, false, true);
    add(c);
  }
  {
    Case c; c.name = "seg_split_q1_k4000_d256"; c.batch = {2}; c.H = 8; c.Hk = 2; c.Lq = 1;
    c.Lk = 4000; c.D = 256; c.seg_docs = 3; c.seg_random = true; add(c);
  }
  {
    Case c; c.name = "seg_vmap_grads_full_d64_causal"; c.batch = {2}; c.kv_batch = {1};
    c.dkv_batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 300; c.Lk = 144; c.D = 64; c.causal = true;
    c.seg_docs = 3; c.seg_shared = true; c.bias = Op({1}, 4, true, true); c.dbias_batch = {2};
    add(c);
  }
  {
    // per-kv-head windows with sinks (sink, left, right): on every kernel generation and path
    Case c; c.name = "windows_q1000_k1000_d128_sinks_causal"; c.H = 8; c.Hk = 4; c.Lq = 1000;
    c.Lk = 1000; c.D = 128; c.causal = true;
    c.head_windows = {{64, 200, 0}, {0, 300, 0}, {130, 0, 0}, {2000, -1, -1}}; add(c);
    c.name = "windows_q1000_k1000_d128_sinks_causal_det"; c.deterministic = true; add(c);
    c.name = "windows_q700_k900_d64_sinks_window_seqlens"; c.deterministic = false;
    c.batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 700; c.Lk = 900; c.D = 64; c.causal = false;
    c.window_left = 400; c.window_right = 30; c.seqlens = true; c.q_lens = {700, 333};
    c.kv_lens = {900, 517}; c.head_windows = {{100, 60, 5}, {1, 500, -1}}; add(c);
    c = Case(); c.name = "windows_q4_k3000_d128_sinks_causal_split"; c.H = 4; c.Hk = 1;
    c.Lq = 4; c.Lk = 3000; c.D = 128; c.causal = true; c.head_windows = {{16, 256, 0}};
    add(c);
    c = Case(); c.name = "windows_q600_k600_d256_sinks_causal_bias"; c.H = 2; c.Hk = 2;
    c.Lq = 600; c.Lk = 600; c.D = 256; c.causal = true; c.bias = Op({1}, 2, true, true);
    c.head_windows = {{64, 100, 0}, {0, 50, 0}}; add(c);
    // the Hopper forward's table kernels (grids of >= 212 CTAs: no key split), D 128 / 64 / 256
    c = Case(); c.name = "windows_hopper_q1024_d128_sinks_causal"; c.H = 16; c.Hk = 4;
    c.Lq = 1024; c.Lk = 1024; c.D = 128; c.causal = true;
    c.head_windows = {{64, 200, 0}, {0, 300, 0}, {130, 0, 0}, {5, 60, 0}}; add(c);
    c.name = "windows_hopper_q1024_d64_sinks_window"; c.H = 32; c.Hk = 8; c.D = 64;
    c.causal = false; c.window_left = 500; c.window_right = 40;
    c.head_windows = {{100, 60, 5}, {1, 200, -1}, {0, 0, 0}, {700, 30, 30},
                      {64, -1, 0}, {2, 5, 100}, {129, 129, 129}, {0, 1000, -1}};
    add(c);
    c = Case(); c.name = "windows_hopper_q896_d256_sinks_causal"; c.H = 16; c.Hk = 2; c.Lq = 896;
    c.Lk = 896; c.D = 256; c.causal = true; c.head_windows = {{64, 100, 0}, {0, 50, 0}};
    add(c);
    c = Case(); c.name = "windows_q300_k300_d32_sinks"; c.H = 2; c.Hk = 1; c.Lq = 300;
    c.Lk = 300; c.D = 32; c.head_windows = {{40, 20, 20}}; add(c);
    c.name = "windows_q300_k300_d128_sinks_mask_det"; c.D = 128; c.causal = true;
    c.deterministic = true; c.mask = Op({1}, 1, true, true); add(c);
    c.name = "windows_q300_k300_d128_sinks_segments_mask"; c.deterministic = false;
    c.seg_docs = 3; add(c);
    c.name = "windows_q300_k300_d128_sinks_segments_mask_det"; c.deterministic = true;
    add(c);
  }
  // the O(L) mask forms: each alone, with a mask, a bias and causality, GQA, lengths, segment ids
  // or a window table; the split forward (the [n] after a name) and large unsplit grids; D 64,
  // 128 and 256; the deterministic backward
  {
    Case c; c.name = "key_ranges_q300_k520_d128"; c.batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 300;
    c.Lk = 520; c.D = 128; c.key_ranges = Form({2}, 4); add(c);
    c = Case(); c.name = "key_ranges_causal_q333_k400_d64_mask_bias"; c.batch = {2}; c.H = 2;
    c.Hk = 1; c.Lq = 333; c.Lk = 400; c.D = 64; c.causal = true; c.key_ranges = Form({1}, 1);
    c.mask = Op({2}, 2, true, true); c.mask_holes = true; c.bias = Op({1}, 2, true, true);
    c.dlse = true; add(c);
    c = Case(); c.name = "key_ranges_gqa8_2_q190_k230_d128_det"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 190; c.Lk = 230; c.D = 128; c.key_ranges = Form({2}, 2);
    c.deterministic = true; add(c);
    c = Case(); c.name = "key_ranges_seqlens_q257_k390_d256_perkey_bias"; c.batch = {3};
    c.H = 2; c.Hk = 2; c.Lq = 257; c.Lk = 390; c.D = 256; c.key_ranges = Form({3}, 1);
    c.seqlens = true; c.q_lens = {257, 100, 0}; c.kv_lens = {390, 129, 50};
    c.bias = Op({3}, 2, false, true); add(c);
    c = Case(); c.name = "key_ranges_segments_causal_q700_k700_d128"; c.H = 2; c.Hk = 2;
    c.Lq = 700; c.Lk = 700; c.D = 128; c.causal = true; c.seg_docs = 4; c.seg_even = true;
    c.key_ranges = Form({1}, 2); add(c);
    c = Case(); c.name = "key_ranges_split_q3_k4000_d128_mask"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 3; c.Lk = 4000; c.D = 128; c.key_ranges = Form({2}, 8);
    c.mask = Op({2}, 2, true, true); add(c);
    c = Case(); c.name = "key_ranges_large_q1024_d128_causal"; c.H = 16; c.Hk = 4; c.Lq = 1024;
    c.Lk = 1024; c.D = 128; c.causal = true; c.key_ranges = Form({1}, 4); add(c);
  }
  {
    Case c; c.name = "row_ranges_q300_k520_d64"; c.batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 300;
    c.Lk = 520; c.D = 64; c.row_ranges = Form({2}, 4); add(c);
    c = Case(); c.name = "row_ranges_causal_q400_k300_d128_mask_bias"; c.H = 4; c.Hk = 4;
    c.Lq = 400; c.Lk = 300; c.D = 128; c.causal = true; c.row_ranges = Form({1}, 1);
    c.mask = Op({1}, 4, true, true); c.bias = Op({1}, 4, true, true); add(c);
    c = Case(); c.name = "row_ranges_gqa8_2_q190_k230_d256_det"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 190; c.Lk = 230; c.D = 256; c.row_ranges = Form({1}, 2);
    c.deterministic = true; add(c);
    c = Case(); c.name = "row_ranges_seqlens_q300_k257_d128_softcap"; c.batch = {2}; c.H = 2;
    c.Hk = 1; c.Lq = 300; c.Lk = 257; c.D = 128; c.row_ranges = Form({2}, 1); c.seqlens = true;
    c.q_lens = {300, 111}; c.kv_lens = {200, 257}; c.softcap = 20.f; c.dlse = true; add(c);
    c = Case(); c.name = "row_ranges_split_q2_k4000_d256_bias"; c.H = 4; c.Hk = 4; c.Lq = 2;
    c.Lk = 4000; c.D = 256; c.row_ranges = Form({1}, 4); c.bias = Op({1}, 4, true, true);
    add(c);
    c = Case(); c.name = "row_ranges_large_q1024_d64_window"; c.H = 32; c.Hk = 8; c.Lq = 1024;
    c.Lk = 1024; c.D = 64; c.window_left = 500; c.window_right = 40;
    c.row_ranges = Form({1}, 32); add(c);
  }
  {
    // block sizes of whole 64-row / 64-key tiles and others (48, 80, 16, 200)
    Case c; c.name = "block_indices_q300_k520_d128_b64_64"; c.batch = {2}; c.H = 4; c.Hk = 2;
    c.Lq = 300; c.Lk = 520; c.D = 128; c.block_indices = Form({2}, 4); c.block_slots = 4;
    add(c);
    c = Case(); c.name = "block_indices_causal_q333_k400_d64_b48_80_mask_bias"; c.H = 2;
    c.Hk = 1; c.Lq = 333; c.Lk = 400; c.D = 64; c.causal = true; c.block_indices = Form({1}, 1);
    c.block_q = 48; c.block_k = 80; c.block_slots = 3; c.mask = Op({1}, 2, true, true);
    c.bias = Op({1}, 2, true, true); add(c);
    c = Case(); c.name = "block_indices_gqa8_2_q300_k1000_d128_b128_200_det"; c.batch = {2};
    c.H = 8; c.Hk = 2; c.Lq = 300; c.Lk = 1000; c.D = 128; c.block_indices = Form({2}, 2);
    c.block_q = 128; c.block_k = 200; c.block_slots = 3; c.deterministic = true; add(c);
    c = Case(); c.name = "block_indices_seqlens_q257_k390_d256_b16_16"; c.batch = {3}; c.H = 2;
    c.Hk = 2; c.Lq = 257; c.Lk = 390; c.D = 256; c.block_indices = Form({3}, 2); c.block_q = 16;
    c.block_k = 16; c.block_slots = 12; c.seqlens = true; c.q_lens = {257, 100, 0};
    c.kv_lens = {390, 129, 50}; add(c);
    c = Case(); c.name = "block_indices_windows_q1000_k1000_d128_b64_128_sinks_causal"; c.H = 8;
    c.Hk = 4; c.Lq = 1000; c.Lk = 1000; c.D = 128; c.causal = true;
    c.head_windows = {{64, 200, 0}, {0, 300, 0}, {130, 0, 0}, {2000, -1, -1}};
    c.block_indices = Form({1}, 8); c.block_k = 128; c.block_slots = 4; add(c);
    c = Case(); c.name = "block_indices_split_q1_k4000_d128_b16_256"; c.batch = {3}; c.H = 8;
    c.Hk = 2; c.Lq = 1; c.Lk = 4000; c.D = 128; c.block_indices = Form({3}, 2); c.block_q = 16;
    c.block_k = 256; c.block_slots = 6; add(c);
    c = Case(); c.name = "block_indices_large_q1024_d128_b128_128"; c.H = 16; c.Hk = 4;
    c.Lq = 1024; c.Lk = 1024; c.D = 128; c.block_indices = Form({1}, 16); c.block_q = 128;
    c.block_k = 128; c.block_slots = 3; add(c);
  }
  {
    // all three forms and-ed with each other and with the rest
    Case c; c.name = "all_forms_q500_k700_d128_b80_48_gqa_mask_bias_causal_seqlens";
    c.batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 500; c.Lk = 700; c.D = 128; c.causal = true;
    c.key_ranges = Form({2}, 2); c.row_ranges = Form({1}, 4); c.block_indices = Form({2}, 1);
    c.block_q = 80; c.block_k = 48; c.block_slots = 12; c.mask = Op({2}, 2, true, true);
    c.bias = Op({2}, 4, true, true); c.seqlens = true; c.q_lens = {500, 321};
    c.kv_lens = {700, 650}; c.dlse = true; add(c);
    c = Case(); c.name = "all_forms_q190_k230_d64_segments_det"; c.H = 2; c.Hk = 2; c.Lq = 190;
    c.Lk = 230; c.D = 64; c.seg_docs = 3; c.key_ranges = Form({1}, 1);
    c.row_ranges = Form({1}, 2); c.block_indices = Form({1}, 2); c.block_slots = 3;
    c.deterministic = true; add(c);
    c = Case(); c.name = "all_forms_split_q4_k3000_d256_b200_200"; c.batch = {2}; c.H = 4;
    c.Hk = 1; c.Lq = 4; c.Lk = 3000; c.D = 256; c.key_ranges = Form({2}, 1);
    c.row_ranges = Form({1}, 4); c.block_indices = Form({2}, 4); c.block_q = 200;
    c.block_k = 200; c.block_slots = 6; add(c);
  }
  {
    // gated attention: exact, and with a cut that drops every odd grid key block
    Case c; c.name = "gate_q300_k520_d128_gqa_causal_mask_bias"; c.batch = {2}; c.H = 4;
    c.Hk = 2; c.Lq = 300; c.Lk = 520; c.D = 128; c.causal = true; c.gate = true;
    c.mask = Op({2}, 4, true, true); c.bias = Op({1}, 4, true, true); add(c);
    c = Case(); c.name = "gate_cut_q600_k700_d64_mask_seqlens"; c.batch = {2}; c.H = 2;
    c.Hk = 1; c.Lq = 600; c.Lk = 700; c.D = 64; c.gate = true; c.gate_cut = -1.5;
    c.mask = Op({1}, 1, true, true); c.seqlens = true; c.q_lens = {600, 257};
    c.kv_lens = {700, 390}; add(c);
    c = Case(); c.name = "gate_cut_split_q4_k3000_d128_softcap"; c.batch = {2}; c.H = 4;
    c.Hk = 1; c.Lq = 4; c.Lk = 3000; c.D = 128; c.gate = true; c.gate_cut = -1.5;
    c.softcap = 20.f; add(c);
    c = Case(); c.name = "gate_cut_q333_k400_d64_segments_key_ranges"; c.H = 2; c.Hk = 2;
    c.Lq = 333; c.Lk = 400; c.D = 64; c.gate = true; c.gate_cut = -1.5; c.seg_docs = 3;
    c.key_ranges = Form({1}, 1); add(c);
    c = Case(); c.name = "gate_cut_det_q300_k400_d128_causal_dlse"; c.H = 4; c.Hk = 1;
    c.Lq = 300; c.Lk = 400; c.D = 128; c.causal = true; c.gate = true; c.gate_cut = -1.5;
    c.deterministic = true; c.dlse = true; add(c);
    // without a mask or bias: the Hopper forward's and backward's gated kernels where they run
    // (the backward's: no softcap; K and V shared over the batch, a CTA's delta changes with
    // the batch entry of its query blocks)
    c = Case(); c.name = "gate_q300_k450_d64_gqa_kv_shared"; c.batch = {3}; c.kv_batch = {1};
    c.H = 4; c.Hk = 2; c.Lq = 300; c.Lk = 450; c.D = 64; c.gate = true; add(c);
    c = Case(); c.name = "gate_cut_q500_k700_d64_window"; c.H = 2; c.Hk = 1; c.Lq = 500;
    c.Lk = 700; c.D = 64; c.gate = true; c.gate_cut = -1.5; c.window_left = 300;
    c.window_right = 200; add(c);
    c = Case(); c.name = "gate_q257_k300_d128_gqa_causal_seqlens"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 257; c.Lk = 300; c.D = 128; c.causal = true; c.gate = true;
    c.seqlens = true; c.q_lens = {257, 100}; c.kv_lens = {300, 180}; add(c);
    c = Case(); c.name = "gate_cut_q400_k700_d64_softcap"; c.H = 4; c.Hk = 4; c.Lq = 400;
    c.Lk = 700; c.D = 64; c.gate = true; c.gate_cut = -1.5; c.softcap = 20.f; add(c);
  }
  {
    // the decode forward (Lq <= 16): the query heads of a kv head packed into one tile; 16 rows
    // a CTA (warps split the keys four ways), 32 (two ways), 64 and more (row blocks)
    Case c; c.name = "decode_q1_g4_k4100_d128_mask_holes_perkey_bias"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 1; c.Lk = 4100; c.D = 128; c.mask = Op({2}, 8, true, true);
    c.mask_holes = true; c.bias = Op({2}, 8, false, true); add(c);
    c = Case(); c.name = "decode_q4_g8_k777_d64_causal_softcap_bias"; c.H = 16; c.Hk = 2;
    c.Lq = 4; c.Lk = 777; c.D = 64; c.causal = true; c.softcap = 5.f; c.qk_std = 1.5f;
    c.bias = Op({1}, 1, true, true); add(c);
    c = Case(); c.name = "decode_q16_g4_k1000_d64_seqlens_window_mask"; c.batch = {3}; c.H = 8;
    c.Hk = 2; c.Lq = 16; c.Lk = 1000; c.D = 64; c.window_left = 100; c.window_right = 0;
    c.seqlens = true; c.q_lens = {16, 5, 0}; c.kv_lens = {1000, 300, 17};
    c.mask = Op({1}, 2, false, true); add(c);
    c = Case(); c.name = "fp16_decode_q16_g8_k600_d128_row_blocks_mask"; c.bf16 = false;
    c.H = 8; c.Hk = 1; c.Lq = 16; c.Lk = 600; c.D = 128; c.mask = Op({1}, 1, true, true);
    c.bias = Op({1}, 8, true, true); add(c);
    c = Case(); c.name = "decode_q2_mha_k3000_d128_windows_sinks_causal"; c.H = 4; c.Hk = 4;
    c.Lq = 2; c.Lk = 3000; c.D = 128; c.causal = true;
    c.head_windows = {{64, 500, 0}, {0, 100, 0}, {16, -1, -1}, {0, 2000, 10}}; add(c);
    c = Case(); c.name = "decode_q3_g2_k20000_d64_all_masked_bias"; c.H = 4; c.Hk = 2;
    c.Lq = 3; c.Lk = 20000; c.D = 64; c.mask = Op({1}, 4, true, true); c.mask_density = 0.f;
    c.bias = Op({1}, 4, true, true); add(c);
    c = Case(); c.name = "decode_q8_g4_k2500_d128_dense_seqlens_dlse"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 8; c.Lk = 2500; c.D = 128; c.seqlens = true; c.q_lens = {8, 8};
    c.kv_lens = {2500, 1}; c.dlse = true; add(c);
  }
  return v;
}

std::vector<Case> QuickCases() {
  std::vector<Case> v;
  {
    // split-KV: one query row against a long masked, biased, length-limited key range
    Case c; c.name = "quick_split_q1_k1000_d128_mask_bias"; c.batch = {2}; c.H = 4; c.Hk = 1;
    c.Lq = 1; c.Lk = 1000; c.D = 128; c.mask = Op({2}, 1, true, true); c.mask_holes = true;
    c.bias = Op({1}, 4, false, true); c.seqlens = true; c.q_lens = {1, 1};
    c.kv_lens = {1000, 517}; v.push_back(c);
  }
  {
    Case c; c.name = "quick_q17_k129_d64_mask_bias"; c.H = 2; c.Hk = 1; c.Lq = 17; c.Lk = 129;
    c.D = 64; c.mask = Op({1}, 2, true, true); c.bias = Op({1}, 2, true, true);
    c.causal = true; v.push_back(c);
  }
  {
    Case c; c.name = "quick_q70_k33_d128_bcast"; c.batch = {2}; c.H = 4; c.Hk = 2; c.Lq = 70;
    c.Lk = 33; c.D = 128; c.mask = Op({1}, 1, false, true); c.bias = Op({2}, 2, false, true);
    v.push_back(c);
  }
  {
    Case c; c.name = "quick_atomic_dbias_d64"; c.batch = {2}; c.H = 2; c.Hk = 2; c.Lq = 40;
    c.Lk = 50; c.D = 64; c.bias = Op({1}, 1, true, true); v.push_back(c);
  }
  {
    // several query blocks per CTA: the backward's prefetch of the next block (mask path)
    Case c; c.name = "quick_q200_k140_d128_mask_bias"; c.H = 2; c.Hk = 1; c.Lq = 200;
    c.Lk = 140; c.D = 128; c.mask = Op({1}, 2, true, true); c.mask_holes = true;
    c.bias = Op({1}, 2, true, true); v.push_back(c);
  }
  {
    // the Hopper forward at D = 64 (192-row tiles): warpgroups that see none of the diagonal's
    // last key blocks, or none of a narrow window's first ones, pass them with the rings
    Case c; c.name = "quick_q400_d64_causal"; c.H = 2; c.Hk = 1; c.Lq = 400; c.Lk = 400;
    c.D = 64; c.causal = true; v.push_back(c);
    c.name = "quick_q400_d64_causal_det"; c.deterministic = true; v.push_back(c);
    c.deterministic = false;
    c.name = "quick_q700_d64_window_mask_bias"; c.Lq = 700; c.Lk = 700; c.causal = false;
    c.window_left = 90; c.window_right = 10; c.mask = Op({1}, 2, true, true);
    c.bias = Op({1}, 2, true, true); v.push_back(c);
  }
  {
    // ... and without a mask (next block's tiles requested at the top of the iteration)
    Case c; c.name = "quick_q260_k130_d64_dense"; c.H = 2; c.Hk = 2; c.Lq = 260; c.Lk = 130;
    c.D = 64; v.push_back(c);
  }
  {
    // the D = 256 wgmma backward (dQ in two chunks), with a full bias (dbias) and a mask
    Case c; c.name = "quick_q90_k130_d256_causal_mask_bias"; c.H = 2; c.Hk = 1; c.Lq = 90;
    c.Lk = 130; c.D = 256; c.causal = true; c.mask = Op({1}, 2, true, true);
    c.bias = Op({1}, 2, true, true); v.push_back(c);
  }
  {
    // the Hopper forward: irregular lengths, causal with Lq < Lk, GQA, sequence lengths
    Case c; c.name = "quick_q17_k129_d128_causal_gqa"; c.batch = {2}; c.H = 4; c.Hk = 2;
    c.Lq = 17; c.Lk = 129; c.D = 128; c.causal = true; v.push_back(c);
  }
  {
    Case c; c.name = "quick_q17_k128_d128_mask_bias_causal"; c.H = 2; c.Hk = 1; c.Lq = 17;
    c.Lk = 128; c.D = 128; c.causal = true; c.mask = Op({1}, 2, true, true);
    c.bias = Op({1}, 1, false, true); v.push_back(c);
  }
  {
    Case c; c.name = "quick_gate_cut_q200_k300_d128_causal_bias"; c.H = 2; c.Hk = 1; c.Lq = 200;
    c.Lk = 300; c.D = 128; c.causal = true; c.gate = true; c.gate_cut = -1.5;
    c.bias = Op({1}, 2, true, true); v.push_back(c);
    // no mask or bias: the Hopper forward's gated kernel
    c = Case(); c.name = "quick_gate_cut_q17_k129_d128_causal"; c.H = 2; c.Hk = 1; c.Lq = 17;
    c.Lk = 129; c.D = 128; c.causal = true; c.gate = true; c.gate_cut = -1.5; v.push_back(c);
    c = Case(); c.name = "quick_gate_q70_k200_d64_kv_shared_seqlens"; c.batch = {2};
    c.kv_batch = {1}; c.H = 2; c.Hk = 1; c.Lq = 70; c.Lk = 200; c.D = 64; c.gate = true;
    c.seqlens = true; c.q_lens = {70, 33}; c.kv_lens = {200, 131}; v.push_back(c);
  }
  {
    Case c; c.name = "quick_q300_k257_d128_seqlens_softcap"; c.batch = {2}; c.H = 2; c.Hk = 1;
    c.Lq = 300; c.Lk = 257; c.D = 128; c.seqlens = true; c.q_lens = {300, 111};
    c.kv_lens = {200, 257}; c.softcap = 20.f; v.push_back(c);
    // the same without softcap: lengths on the warp-specialised Hopper backward
    c.name = "quick_q300_k257_d128_seqlens_gqa"; c.H = 4; c.softcap = 0.f; v.push_back(c);
    c.name = "quick_q300_k257_d128_seqlens_gqa_det"; c.deterministic = true; v.push_back(c);
  }
  {
    // masks on the warp-specialised Hopper backward: a mask per kv head with empty rows and
    // tiles (causal, GQA), and one broadcast over queries (its one row of bits) with a window
    Case c; c.name = "quick_q333_k300_d128_mask_gqa_causal"; c.batch = {2}; c.H = 4; c.Hk = 2;
    c.Lq = 333; c.Lk = 300; c.D = 128; c.causal = true; c.mask = Op({2}, 2, true, true);
    c.mask_holes = true; v.push_back(c);
    c = Case(); c.name = "quick_q200_k260_d64_mask_keys_window"; c.H = 2; c.Hk = 1; c.Lq = 200;
    c.Lk = 260; c.D = 64; c.window_left = 100; c.window_right = 30;
    c.mask = Op({1}, 1, false, true); v.push_back(c);
  }
  {
    // biases on the warp-specialised Hopper backward (key lengths of whole 16-byte rows): a full
    // one (its dbias stored from the dS tiles) beside a mask with empty rows and tiles; one
    // broadcast over queries, batch and heads, not differentiated (one row of keys per block);
    // one broadcast over batch and heads, not differentiated (tiles of one entry)
    Case c; c.name = "quick_q333_k320_d128_mask_bias_gqa_causal"; c.batch = {2}; c.H = 4;
    c.Hk = 2; c.Lq = 333; c.Lk = 320; c.D = 128; c.causal = true; c.mask = Op({2}, 2, true, true);
    c.mask_holes = true; c.bias = Op({2}, 4, true, true); v.push_back(c);
    c = Case(); c.name = "quick_q200_k264_d64_bias_1row_window_nodbias"; c.batch = {2}; c.H = 2;
    c.Hk = 1; c.Lq = 200; c.Lk = 264; c.D = 64; c.window_left = 100; c.window_right = 30;
    c.bias = Op({1}, 1, false, true); c.dbias = false; v.push_back(c);
    c = Case(); c.name = "quick_q130_k256_d128_bias_bcast_nodbias"; c.batch = {2}; c.H = 4;
    c.Hk = 4; c.Lq = 130; c.Lk = 256; c.D = 128; c.bias = Op({1}, 1, true, true);
    c.dbias = false; v.push_back(c);
  }
  {
    // both block orders (as ordered_q1100_k4100_d128_mask_seqlens), on a 10 % block mask
    Case c; c.name = "quick_ordered_q1100_k4100_d128_mask"; c.H = 16; c.Hk = 4; c.Lq = 1100;
    c.Lk = 4100; c.D = 128; c.mask = Op({1}, 16, true, true); c.block_density = 0.1f;
    v.push_back(c);
  }
  {
    Case c; c.name = "quick_seg_q130_k300_d128_mask_bias_causal"; c.batch = {2}; c.H = 2;
    c.Hk = 1; c.Lq = 130; c.Lk = 300; c.D = 128; c.causal = true; c.seg_docs = 4;
    c.mask = Op({2}, 1, true, true); c.bias = Op({2}, 2, true, true); v.push_back(c);
  }
  {
    // the warp-specialised Hopper backward's segment kernel (no mask, bias or deterministic dQ):
    // ids at random (every tile's pairs compared), documents with sequence lengths
    Case c; c.name = "quick_seg_random_q200_k257_d128_gqa_causal"; c.batch = {2}; c.H = 4;
    c.Hk = 2; c.Lq = 200; c.Lk = 257; c.D = 128; c.causal = true; c.seg_docs = 3;
    c.seg_random = true; v.push_back(c);
    c = Case(); c.name = "quick_seg_packed_q333_k300_d64_seqlens"; c.batch = {2}; c.H = 2;
    c.Hk = 1; c.Lq = 333; c.Lk = 300; c.D = 64; c.seg_docs = 4; c.seqlens = true;
    c.q_lens = {333, 100}; c.kv_lens = {300, 129}; v.push_back(c);
  }
  {
    Case c; c.name = "quick_seg_random_q70_k90_d64_det"; c.H = 2; c.Hk = 2; c.Lq = 70;
    c.Lk = 90; c.D = 64; c.seg_docs = 2; c.seg_random = true; c.deterministic = true;
    v.push_back(c);
  }
  {
    // per-kv-head windows with sinks: a sink apart from the band (the walks step over the gap),
    // one inside it, none; with the operand rings and the dbias zero fill
    Case c; c.name = "quick_windows_q300_k300_d128_sinks_causal_mask_bias"; c.H = 6; c.Hk = 3;
    c.Lq = 300; c.Lk = 300; c.D = 128; c.causal = true; c.mask = Op({1}, 3, true, true);
    c.bias = Op({1}, 6, true, true); c.head_windows = {{5, 40, 0}, {150, 20, 0}, {0, 100, 0}};
    v.push_back(c);
    c.name = "quick_windows_q200_k333_d64_sinks"; c.H = 4; c.Hk = 2; c.Lq = 200; c.Lk = 333;
    c.D = 64; c.causal = false; c.mask = {}; c.bias = {};
    c.head_windows = {{70, 30, 20}, {3, -1, 10}}; v.push_back(c);
  }
  {
    // ... on the Hopper forward (a grid that the dispatcher does not split: 224 CTAs)
    Case c; c.name = "quick_windows_hopper_q448_d128_sinks_mask_bias"; c.H = 32; c.Hk = 8;
    c.Lq = 448; c.Lk = 448; c.D = 128; c.causal = true; c.mask = Op({1}, 8, true, true);
    c.bias = Op({1}, 32, true, true);
    c.head_windows = {{5, 40, 0}, {150, 20, 0}, {0, 100, 0}, {129, 0, 0},
                      {64, 200, 0}, {1, 1, 0}, {300, 64, 0}, {0, -1, 0}};
    v.push_back(c);
  }
  {
    // ... beside segment ids (kernels that read both)
    Case c; c.name = "quick_windows_q260_k300_d128_sinks_segments"; c.batch = {2}; c.H = 4;
    c.Hk = 2; c.Lq = 260; c.Lk = 300; c.D = 128; c.causal = true; c.seg_docs = 3;
    c.bias = Op({2}, 4, true, true); c.head_windows = {{5, 30, 0}, {140, 10, 0}};
    v.push_back(c);
  }
  {
    // the O(L) mask forms: each, with a mask and bias, lengths, the dq kernel; all three at once
    Case c; c.name = "quick_key_ranges_q17_k129_d64_mask_bias_causal"; c.H = 2; c.Hk = 1;
    c.Lq = 17; c.Lk = 129; c.D = 64; c.causal = true; c.key_ranges = Form({1}, 1);
    c.mask = Op({1}, 2, true, true); c.bias = Op({1}, 2, true, true); v.push_back(c);
    c = Case(); c.name = "quick_row_ranges_q70_k33_d128_seqlens_det"; c.batch = {2}; c.H = 4;
    c.Hk = 2; c.Lq = 70; c.Lk = 33; c.D = 128; c.row_ranges = Form({2}, 2); c.seqlens = true;
    c.q_lens = {70, 41}; c.kv_lens = {33, 20}; c.deterministic = true; v.push_back(c);
    c = Case(); c.name = "quick_block_indices_key_row_ranges_q130_k300_d128_b48_80";
    c.batch = {2}; c.H = 2; c.Hk = 1; c.Lq = 130; c.Lk = 300; c.D = 128;
    c.block_indices = Form({2}, 2); c.block_q = 48; c.block_k = 80; c.block_slots = 3;
    c.key_ranges = Form({1}, 1); c.row_ranges = Form({2}, 2); c.bias = Op({2}, 2, true, true);
    v.push_back(c);
  }
  {
    // the decode forward: packed heads, split keys, mask holes, per-key bias, lengths, softcap
    Case c; c.name = "quick_decode_q3_g4_k700_d128_mask_bias_softcap"; c.batch = {2}; c.H = 8;
    c.Hk = 2; c.Lq = 3; c.Lk = 700; c.D = 128; c.mask = Op({2}, 2, true, true);
    c.mask_holes = true; c.bias = Op({2}, 8, false, true); c.softcap = 4.f; c.seqlens = true;
    c.q_lens = {3, 2}; c.kv_lens = {700, 129}; v.push_back(c);
    c = Case(); c.name = "quick_decode_q16_g8_k300_d64_row_blocks_causal"; c.H = 8; c.Hk = 1;
    c.Lq = 16; c.Lk = 300; c.D = 64; c.causal = true; c.bias = Op({1}, 8, true, true);
    v.push_back(c);
  }
  return v;
}

bool Compiled(const Case& c) {
  return dmattn::cuda::SupportsHeadDim(c.D) && DtypeCompiled(c.bf16);
}

// The dynamic-mask kernels (cuda/dynamic.h) against brute force on small irregular shapes (part
// of --quick, so that compute-sanitizer covers them).

// Mismatches of leave[r, j] = index of the window-th key beating key j (keys before j with a
// key >= its own, after j with a key >), or lk.
int64_t CheckTopkLeave(std::mt19937& rng, int64_t rows, int64_t lk, int64_t window) {
  std::uniform_int_distribution<int32_t> draw(-20, 20);  // many ties
  std::vector<int32_t> key(rows * lk);
  for (auto& x : key) x = draw(rng);
  int32_t* d_key = Upload(key);
  int32_t* d_leave = Upload(std::vector<int32_t>(rows * lk, -7));
  CK(dmattn::cuda::TopkLeave(d_key, d_leave, rows, lk, window, nullptr));
  const std::vector<int32_t> leave = Download(d_leave, rows * lk);
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < lk; ++j) {
      const int32_t* k = key.data() + r * lk;
      int64_t beaters = 0, expected = lk;
      for (int64_t i = 0; i < lk && expected == lk; ++i) {
        if (i != j && (i < j ? k[i] >= k[j] : k[i] > k[j]) && ++beaters == window) expected = i;
      }
      bad += leave[r * lk + j] != expected;
    }
  CK(cudaFree(d_key));
  CK(cudaFree(d_leave));
  return bad;
}

// Mismatches of mask[g, n, r, u] = first[g, n, u] <= n * block + r < end[g, n, u].
int64_t CheckRangeMask(std::mt19937& rng, int64_t groups, int64_t nb, int64_t block,
                       int64_t slots) {
  std::uniform_int_distribution<int32_t> draw(-5, static_cast<int32_t>(nb * block + 5));
  std::vector<int32_t> first(groups * nb * slots), end(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    first[i] = draw(rng);
    end[i] = draw(rng);
  }
  int32_t* d_first = Upload(first);
  int32_t* d_end = Upload(end);
  const size_t n = groups * nb * block * slots;
  bool* d_mask = nullptr;
  CK(cudaMalloc(&d_mask, n));
  CK(cudaMemset(d_mask, 7, n));
  CK(dmattn::cuda::RangeMask(d_first, d_end, d_mask, groups * nb, nb, block, slots, nullptr));
  const std::vector<uint8_t> mask = Download(reinterpret_cast<const uint8_t*>(d_mask), n);
  int64_t bad = 0;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t r = 0; r < block; ++r)
        for (int64_t u = 0; u < slots; ++u) {
          const int64_t range = (g * nb + b) * slots + u, row = b * block + r;
          const uint8_t expected = first[range] <= row && row < end[range];
          bad += mask[((g * nb + b) * block + r) * slots + u] != expected;
        }
  CK(cudaFree(d_first));
  CK(cudaFree(d_end));
  CK(cudaFree(d_mask));
  return bad;
}

// Mismatches of out[b, j, c] = sum over blocks n in [span0, span1) of
// grad[b, n, slots[b, cc, n, j], c] (float32; slots outside [0, U) list nothing).
int64_t CheckSumListedKeys(std::mt19937& rng, dmattn::ListedKeysShape s) {
  s.dtype = dmattn::ElementType::kFloat32;
  const int64_t B = s.batch, nb = s.blocks, U = s.slots, C = s.channels, D = s.dim;
  const int64_t Cc = s.key_channels, lk = s.seqlen_k;
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int32_t> slot(-1, static_cast<int32_t>(U));
  std::uniform_int_distribution<int32_t> block(-1, static_cast<int32_t>(nb + 1));
  std::vector<float> grad(B * nb * U * C * D);
  for (auto& x : grad) x = normal(rng);
  std::vector<int32_t> slots(B * Cc * nb * lk), spans(B * Cc * 2 * lk);
  for (auto& x : slots) x = slot(rng);
  for (auto& x : spans) x = block(rng);
  float* d_grad = Upload(grad);
  int32_t* d_slots = Upload(slots);
  int32_t* d_spans = Upload(spans);
  float* d_out = Upload(std::vector<float>(B * lk * C * D, 1e9f));
  dmattn::ListedKeysArgs a;
  a.grad = d_grad;
  a.slots = d_slots;
  a.spans = d_spans;
  a.out = d_out;
  CK(dmattn::cuda::SumListedKeys(s, a, nullptr));
  const std::vector<float> out = Download(d_out, B * lk * C * D);
  int64_t bad = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < lk; ++j)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t cc = Cc == 1 ? 0 : c;
        const int32_t* span = spans.data() + (b * Cc + cc) * 2 * lk;
        const int64_t n_end = std::min<int64_t>(span[lk + j], nb);
        for (int64_t d = 0; d < D; ++d) {
          double sum = 0.0, mag = 0.0;
          for (int64_t n = std::max(span[j], 0); n < n_end; ++n) {
            const int32_t u = slots[((b * Cc + cc) * nb + n) * lk + j];
            if (u < 0 || u >= U) continue;
            const float g = grad[(((b * nb + n) * U + u) * C + c) * D + d];
            sum += g;
            mag += std::fabs(g);
          }
          bad += std::fabs(out[((b * lk + j) * C + c) * D + d] - sum) > 1e-5 * (mag + 1.0);
        }
      }
  CK(cudaFree(d_grad));
  CK(cudaFree(d_slots));
  CK(cudaFree(d_spans));
  CK(cudaFree(d_out));
  return bad;
}

// Forward and Backward refuse a scale <= 0 (or not finite) before reading any operand.
bool ScaleRefusals() {
  bool ok = true;
  for (float scale : {0.f, -0.3f, std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
    AttentionShape s;
    s.dtype = ElementType::kBFloat16;
    s.num_heads = s.num_kv_heads = 1;  // valid but for the scale
    s.head_dim = 64;
    s.scale = scale;
    const cudaError_t f = dmattn::cuda::Forward(s, ForwardArgs{}, nullptr);
    const cudaError_t b = dmattn::cuda::Backward(s, BackwardArgs{}, nullptr);
    if (f != cudaErrorInvalidValue || b != cudaErrorInvalidValue) {
      std::printf("    scale %g: Forward %s, Backward %s (want cudaErrorInvalidValue)\n", scale,
                  cudaGetErrorName(f), cudaGetErrorName(b));
      ok = false;
    }
  }
  std::printf("%-36s %s\n", "scale_refusals", ok ? "PASS" : "FAIL");
  return ok;
}

bool DynamicKernelChecks() {
  std::mt19937 rng(99);
  int64_t bad = 0;
  auto tally = [&](const char* what, int64_t n) {
    if (n) std::printf("    %s: %lld mismatches\n", what, static_cast<long long>(n));
    bad += n;
  };
  for (int64_t window : {1, 50, 700, 1000}) {
    tally("TopkLeave", CheckTopkLeave(rng, 3, 700, window));
  }
  tally("TopkLeave", CheckTopkLeave(rng, 2, 2100, 33));
  tally("RangeMask", CheckRangeMask(rng, 2, 3, 40, 37));
  tally("RangeMask", CheckRangeMask(rng, 1, 2, 512, 304));
  for (int64_t dim : {1, 6, 20, 130, 300}) {
    for (int64_t key_channels : {1, 3}) {
      dmattn::ListedKeysShape s;
      s.batch = 2;
      s.blocks = 5;
      s.slots = 7;
      s.channels = 3;
      s.dim = dim;
      s.key_channels = key_channels;
      s.seqlen_k = 41;
      tally("SumListedKeys", CheckSumListedKeys(rng, s));
    }
  }
  std::printf("%-36s %s (TopkLeave, RangeMask, SumListedKeys vs brute force: %lld mismatches)\n",
              "dynamic_kernels", bad ? "FAIL" : "PASS", static_cast<long long>(bad));
  return bad == 0;
}

// ---------------------------------------------------------------------------------------------
// only: run the benchmarks whose name contains it (all when empty).
void Bench(bool variants, const std::string& only) {
  struct B {
    const char* name;
    Case c;
    double flops_fwd;
  };
  std::vector<B> benches;
  auto mk = [](const char* n, int64_t b, int64_t h, int64_t hk, int64_t l, int64_t d, bool causal,
               bool maskbias, bool perkey) {
    Case c;
    c.name = n;
    c.batch = {b};
    c.H = h;
    c.Hk = hk;
    c.Lq = l;
    c.Lk = l;
    c.D = d;
    c.causal = causal;
    if (maskbias) {
      c.mask = Op({b}, h, true, true);
      c.bias = Op({b}, h, true, true);
      c.mask_density = 1.f;
    }
    if (perkey) {
      c.bias = Op({b}, hk, false, true);
      c.mask = Op({b}, hk, true, true);
      c.mask_density = 1.f;
    }
    return c;
  };
  {
    // issue 26: decoding, one (or 16) query rows against a long KV cache, H32 / Hk8
    Case c = mk("b11", 8, 32, 8, 1, 128, false, false, false);
    c.Lk = 32768;
    benches.push_back({"decode B8 Lq1 Lk32k H32 Hk8 d128", c, 0});
    c.bias = Op({8}, 32, false, true);
    benches.push_back({"decode B8 Lq1 Lk32k H32 Hk8 d128 per-key bias", c, 0});
    c = mk("b12", 1, 32, 8, 1, 128, false, false, false);
    c.Lk = 131072;
    benches.push_back({"decode B1 Lq1 Lk128k H32 Hk8 d128", c, 0});
    c = mk("b13", 8, 32, 8, 16, 128, false, false, false);
    c.Lk = 32768;
    benches.push_back({"decode B8 Lq16 Lk32k H32 Hk8 d128", c, 0});
    c.bias = Op({8}, 32, false, true);
    benches.push_back({"decode B8 Lq16 Lk32k H32 Hk8 d128 per-key bias", c, 0});
  }
  benches.push_back({"dense d128 L4k B4 H16", mk("b1", 4, 16, 16, 4096, 128, false, false, false), 0});
  {
    Case c = mk("b1d", 4, 16, 16, 4096, 128, false, false, false);
    c.deterministic = true;
    benches.push_back({"dense d128 L4k B4 H16 (deterministic)", c, 0});
  }
  benches.push_back({"dense d128 L4k B4 H16 causal", mk("b2", 4, 16, 16, 4096, 128, true, false, false), 0});
  benches.push_back({"dense d128 L16k B1 H16", mk("b1l", 1, 16, 16, 16384, 128, false, false, false), 0});
  benches.push_back({"dense d128 L16k B1 H16 causal", mk("b2l", 1, 16, 16, 16384, 128, true, false, false), 0});
  {
    // sequence packing: 8 documents of 2k, block-diagonal causal (dense causal flops)
    Case c = mk("b2p", 1, 16, 16, 16384, 128, true, false, false);
    c.seg_docs = 8;
    c.seg_even = true;
    benches.push_back({"packed 8 docs L16k H16 d128 causal (dense flops)", c, 0});
    // the same documents as a batch: what packing should cost (issue 24: within 1.15x)
    benches.push_back({"8 docs as a batch B8 L2k H16 d128 causal",
                       mk("b2b", 8, 16, 16, 2048, 128, true, false, false), 0});
  }
  benches.push_back({"dense d64 L4k B4 H32", mk("b3", 4, 32, 32, 4096, 64, false, false, false), 0});
  {
    Case c = mk("b3d", 4, 32, 32, 4096, 64, false, false, false);
    c.deterministic = true;
    benches.push_back({"dense d64 L4k B4 H32 (deterministic)", c, 0});
  }
  benches.push_back({"dense d64 L4k B4 H32 causal", mk("b3c", 4, 32, 32, 4096, 64, true, false, false), 0});
  // a grid of 128 CTAs on the 128-key tile: the backward takes the 64-key tile (UseNarrow)
  benches.push_back({"dense d64 L8k B1 H16 Hk2 (small grid)", mk("b3g", 1, 16, 2, 8192, 64, false, false, false), 0});
  benches.push_back({"dense d64 L16k B1 H32 causal", mk("b3l", 1, 32, 32, 16384, 64, true, false, false), 0});
  benches.push_back({"dense d256 L4k B2 H8", mk("b7", 2, 8, 8, 4096, 256, false, false, false), 0});
  benches.push_back({"bias+mask[B,H,L,L] d128 L4k B4 H16 causal", mk("b4", 4, 16, 16, 4096, 128, true, true, false), 0});
  {
    // the JAX bias + mask suite's mask: every element kept with p = 0.5 (no tile is all true)
    Case c = mk("b4h", 4, 16, 16, 4096, 128, true, true, false);
    c.mask_density = 0.5f;
    benches.push_back({"bias+mask[B,H,L,L] 50% d128 L4k B4 H16 causal", c, 0});
    // the same without dbias: what dbias's stores and zeros cost
    c.dbias = false;
    benches.push_back({"bias+mask[B,H,L,L] 50% d128 L4k B4 H16 causal (no dbias)", c, 0});
  }
  benches.push_back({"per-key bias, mask[B,Hk,L,L] d128 L16k H2 Hk1 causal", mk("b5", 1, 2, 1, 16384, 128, true, false, true), 0});
  {
    // dynamic_attention's small problems at L16k W1024: 32 query blocks of 512 rows, 1536 keys
    Case c = mk("b8", 32, 2, 1, 512, 128, false, false, true);
    c.Lk = 1536;
    c.mask_density = 0.67f;
    benches.push_back({"per-key bias, mask[B,1,512,1536] d128 B32 H2 Hk1", c, 0});
  }
  {
    Case c = mk("b6", 1, 16, 16, 8192, 128, false, false, false);
    c.mask = Op({1}, 1, true, true);
    c.mask_density = 1.f;
    benches.push_back({"mask[1,1,L,L] all true d128 L8k H16", c, 0});
    c.mask_density = 0.5f;
    benches.push_back({"mask[1,1,L,L] 50% d128 L8k H16", c, 0});
    c.mask_density = 1.f;
    c.block_density = 0.1f;
    benches.push_back({"mask[1,1,L,L] 10% 128-blocks d128 L8k H16 (dense flops)", c, 0});
    // what the sparse forward pays for far-apart blocks: the same query blocks all seeing every
    // 10th key block, or the first tenth, and the dense kernel on those keys alone
    c.block_density = 0.f;
    c.key_block_step = 10;
    benches.push_back({"mask[1,1,L,L] every 10th key block d128 L8k H16 (dense flops)", c, 0});
    c.key_blocks_first = true;
    benches.push_back({"mask[1,1,L,L] first 10th of key blocks d128 L8k H16 (dense flops)", c, 0});
    Case d = mk("b6d", 1, 16, 16, 8192, 128, false, false, false);
    d.Lk = 7 * 128;
    benches.push_back({"dense d128 Lq8k Lk896 H16", d, 0});
  }
  {
    Case c = mk("b9", 1, 2, 1, 16384, 128, false, false, false);
    c.mask = Op({1}, 1, true, true);
    c.block_density = 0.1f;
    benches.push_back({"mask[1,1,L,L] 10% 128-blocks d128 L16k H2 Hk1 (dense flops)", c, 0});
  }
  {
    // issue 27: gated attention, exact and with a cut that drops three of every four grid key
    // blocks (the Hopper kernels where they run), against the same call without the gate and
    // the FlashAttention-2-class kernels without the gate (key ranges hiding nothing: the
    // kFormsAndIds kernels that gated calls with mask forms run)
    Case c = mk("b12", 1, 16, 16, 16384, 128, true, false, false);
    c.key_ranges = Form({1}, 1);
    c.key_ranges_all = true;
    benches.push_back({"key ranges (all visible) d128 L16k H16 causal", c, 0});
    c = mk("b12g", 1, 16, 16, 16384, 128, true, false, false);
    benches.push_back({"no gate (gate bench shape) d128 L16k H16 causal", c, 0});
    c.gate = true;
    benches.push_back({"gate d128 L16k H16 causal", c, 0});
    c.gate_cut = -1.5;
    c.gate_keep_every = 4;
    benches.push_back({"gate, cut dropping 3/4 of the key blocks d128 L16k H16 causal", c, 0});
  }
  {
    // issue 27: a sink + window vs the same window without sinks (flops of the dense causal call)
    Case c = mk("b10", 1, 16, 16, 16384, 128, true, false, false);
    c.head_windows.assign(16, {0, 1024, 0});
    benches.push_back({"window 1024 (table) d128 L16k H16 causal (dense flops)", c, 0});
    c.head_windows.assign(16, {64, 1024, 0});
    benches.push_back({"sink 64 + window 1024 d128 L16k H16 causal (dense flops)", c, 0});
  }
  std::printf("\n%-55s %10s %10s %10s %10s\n", "bench (bf16)", "fwd ms", "fwd TF/s", "bwd ms",
              "bwd TF/s");
  for (auto& b : benches) {
    if (!Compiled(b.c) || std::string(b.name).find(only) == std::string::npos) continue;
    Problem P = Build(b.c, 7, true);
    Buffers in = UploadInputs(P);
    const double fl = 4.0 * P.B * b.c.H * b.c.Lq * b.c.Lk * b.c.D * (b.c.causal ? 0.5 : 1.0);
    // variant 0 = the library's tiles; then the tuning build's alternatives (skipped for
    // deterministic runs, whose dq kernel has no alternatives)
    const int nf = variants ? NumVariants(false, b.c.D, b.c.bf16) : 0;
    const int nb = variants && !b.c.deterministic ? NumVariants(true, b.c.D, b.c.bf16) : 0;
    for (int v = 0; v <= std::max(nf, nb); ++v) {
      float mf = 0, mb = 0;
      DeviceOut o;
      SetVariant(v <= nf ? v : 0);
      FwdOut f = RunForwardDevice(P, in, &o, &mf, 10);
      SetVariant(v <= nb ? v : 0);
      if (v <= nb) RunBackwardDevice(P, in, f, &o, &mb, 10);
      SetVariant(0);
      FreeFwd(f);
      char label[96];
      std::snprintf(label, sizeof(label), "  ^ variant %d", v);
      std::printf("%-55s %10.3f %10.1f", v == 0 ? b.name : label, mf, fl / mf / 1e9);
      if (v <= nb) {
        std::printf(" %10.3f %10.1f\n", mb, 2.5 * fl / mb / 1e9);
      } else {
        std::printf(" %10s %10s\n", "-", "-");
      }
      std::fflush(stdout);
    }
    if (HopperGpu()) {  // the FlashAttention-2-class forward beside the dispatcher's choice
      float mf = 0;
      DeviceOut o;
      dmattn::cuda::SetForwardKernel(dmattn::cuda::ForwardKernel::kFlash2);
      FwdOut f = RunForwardDevice(P, in, &o, &mf, 10);
      dmattn::cuda::SetForwardKernel(dmattn::cuda::ForwardKernel::kAuto);
      FreeFwd(f);
      std::printf("%-55s %10.3f %10.1f %10s %10s\n", "  ^ FlashAttention-2-class forward", mf,
                  fl / mf / 1e9, "-", "-");
      std::fflush(stdout);
      float mb = 0;  // and the FlashAttention-2-class backward
      f = RunForwardDevice(P, in, &o, nullptr, 0);
      dmattn::cuda::SetBackwardKernel(dmattn::cuda::BackwardKernel::kFlash2);
      RunBackwardDevice(P, in, f, &o, &mb, 10);
      dmattn::cuda::SetBackwardKernel(dmattn::cuda::BackwardKernel::kAuto);
      FreeFwd(f);
      std::printf("%-55s %10s %10s %10.3f %10.1f\n", "  ^ FlashAttention-2-class backward", "-",
                  "-", mb, 2.5 * fl / mb / 1e9);
      std::fflush(stdout);
    }
    if (b.c.mask.present && b.c.mask.rows && b.c.mask.cols) {  // the same, plain block order
      float mf = 0, mb = 0;
      DeviceOut o;
      FwdOut f = RunForwardDevice(P, in, &o, &mf, 10, false);
      RunBackwardDevice(P, in, f, &o, &mb, 10, false);
      FreeFwd(f);
      std::printf("%-55s %10.3f %10.1f %10.3f %10.1f\n", "  ^ plain block order", mf,
                  fl / mf / 1e9, mb, 2.5 * fl / mb / 1e9);
      std::fflush(stdout);
    }
    FreeInputs(in);
  }
}

// Split-KV against the same forward unsplit, on decode-like shapes.
void BenchSplits() {
  struct Shape {
    int64_t b, h, hk, lq, lk, d;
  };
  const Shape shapes[] = {{1, 32, 8, 1, 32768, 128}, {8, 32, 8, 1, 8192, 128},
                          {1, 16, 16, 128, 16384, 128}, {2, 8, 8, 512, 8192, 64}};
  std::printf("\n%-44s %7s %12s %12s %8s\n", "forward, split-KV vs unsplit (bf16)", "splits",
              "split ms", "unsplit ms", "ratio");
  for (const Shape& x : shapes) {
    Case c;
    c.batch = {x.b};
    c.H = x.h;
    c.Hk = x.hk;
    c.Lq = x.lq;
    c.Lk = x.lk;
    c.D = x.d;
    if (!Compiled(c)) continue;
    Problem P = Build(c, 11, true);
    Buffers in = UploadInputs(P);
    DeviceOut o;
    float split_ms = 0, unsplit_ms = 0;
    FwdOut f = RunForwardDevice(P, in, &o, &split_ms, 20);
    FreeFwd(f);
    f = RunForwardDevice(P, in, &o, &unsplit_ms, 20, false);
    FreeFwd(f);
    FreeInputs(in);
    char name[64];
    std::snprintf(name, sizeof(name), "B%lld H%lld Hk%lld Lq%lld Lk%lld D%lld",
                  static_cast<long long>(x.b), static_cast<long long>(x.h),
                  static_cast<long long>(x.hk), static_cast<long long>(x.lq),
                  static_cast<long long>(x.lk), static_cast<long long>(x.d));
    std::printf("%-44s %7lld %12.4f %12.4f %8.3f\n", name,
                static_cast<long long>(dmattn::cuda::ForwardSplits(P.s)), split_ms, unsplit_ms,
                split_ms / unsplit_ms);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, bench = false, list = false, bench_only = false, variants = false;
  std::string only, exact;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--bench")) bench = true;
    if (!std::strcmp(argv[i], "--list")) list = true;
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    if (!std::strcmp(argv[i], "--case") && i + 1 < argc) exact = argv[++i];
    if (!std::strcmp(argv[i], "--bench-only")) bench = bench_only = true;
    if (!std::strcmp(argv[i], "--variants")) variants = true;
  }
  if (list) {
    for (const Case& c : AllCases()) std::printf("%s\n", c.name.c_str());
    std::printf("dynamic_kernels\nscale_refusals\n");
    return 0;
  }
  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

  const std::vector<Case> cases = quick ? QuickCases() : AllCases();
  int failures = 0, ran = 0, variant_failures = 0;
  std::printf("%-36s %-4s %8s %8s %8s %8s %8s %8s %5s %s\n", "case", "dt", "out", "lse_abs",
              "dq", "dk", "dv", "dbias", "det", "status");
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    if (bench_only) break;
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    if (!exact.empty() && c.name != exact) continue;
    if (!Compiled(c)) {
      std::printf("%-36s skipped (head dim %lld / dtype not compiled)\n", c.name.c_str(),
                  static_cast<long long>(c.D));
      continue;
    }
    ++ran;
    Problem P = Build(c, 1234 + ci);
    Ref R = Reference(P);
    Buffers in = UploadInputs(P);
    DeviceOut o;
    FwdOut f = RunForwardDevice(P, in, &o, nullptr, 0);
    Err eo = Compare16(o.out, R.out, P.dt);
    Err el = CompareLse(o.lse, R.lse);
    const int64_t splits = dmattn::cuda::ForwardSplits(P.s);
    const bool decode = std::string(dmattn::cuda::ForwardKernelName(P.s)) == "decode";
    const bool paged_ok = !decode || PagedMatchesContiguous(P, in, o);
    if (HopperGpu()) {  // the FlashAttention-2-class forward too: both generations must pass
      dmattn::cuda::SetForwardKernel(dmattn::cuda::ForwardKernel::kFlash2);
      DeviceOut o2;
      FwdOut f2 = RunForwardDevice(P, in, &o2, nullptr, 0);
      dmattn::cuda::SetForwardKernel(dmattn::cuda::ForwardKernel::kAuto);
      FreeFwd(f2);
      eo = Worse(eo, Compare16(o2.out, R.out, P.dt));
      el = Worse(el, CompareLse(o2.lse, R.lse));
    }
    {  // the same forward without its workspace (unsplit, plain order): both paths must pass
      DeviceOut o1;
      FwdOut f1 = RunForwardDevice(P, in, &o1, nullptr, 0, false);
      FreeFwd(f1);
      eo = Worse(eo, Compare16(o1.out, R.out, P.dt));
      el = Worse(el, CompareLse(o1.lse, R.lse));
    }
    // rows with no visible key: exactly zero output
    bool zero_ok = true;
    for (int64_t b = 0; b < P.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.Lq; ++i) {
          if (!R.empty_row[P.s.lse_offset(b, h) + i]) continue;
          for (int64_t e = 0; e < c.D; ++e)
            if (P.dt.dec(o.out[P.s.q_offset(b, h) + i * P.s.q_row_stride() + e]) != 0.f)
              zero_ok = false;
        }
    const std::string label = c.name + (splits > 1 ? " [" + std::to_string(splits) + "]" : "");
    std::printf("%-36s %-4s %8.1e %8.1e ", label.c_str(), c.bf16 ? "bf16" : "fp16", eo.rel,
                el.rel);
    std::fflush(stdout);
    RunBackwardDevice(P, in, f, &o, nullptr, 0);
    DeviceOut plain;  // the same backward in plain key-block order: both paths must pass
    RunBackwardDevice(P, in, f, &plain, nullptr, 0, false);
    // On Hopper the FlashAttention-2-class backward too (the dispatcher's choice may be the
    // warp-specialised one): both generations must pass.
    const bool flash2_bwd = HopperGpu();
    const bool checks_dbias = P.s.bias.present && c.dbias;
    DeviceOut flash2;
    if (flash2_bwd) {
      dmattn::cuda::SetBackwardKernel(dmattn::cuda::BackwardKernel::kFlash2);
      RunBackwardDevice(P, in, f, &flash2, nullptr, 0);
      dmattn::cuda::SetBackwardKernel(dmattn::cuda::BackwardKernel::kAuto);
    }
    bool det_ok = true;
    if (c.deterministic) {
      DeviceOut o2;
      RunBackwardDevice(P, in, f, &o2, nullptr, 0);
      det_ok = o2.dq == o.dq && o2.dk == o.dk && o2.dv == o.dv && o2.dbias == o.dbias;
    }
    // alternative tiles of a tuning build: same checks, reported below the case's line
    std::string vlines;
    const int nf = variants ? NumVariants(false, c.D, c.bf16) : 0;
    const int nb = variants && !c.deterministic ? NumVariants(true, c.D, c.bf16) : 0;
    for (int v = 1; v <= std::max(nf, nb); ++v) {
      DeviceOut ov;
      Err vo, vl, vq, vk, vv, vb;
      if (v <= nf) {
        SetVariant(v);
        FwdOut fv = RunForwardDevice(P, in, &ov, nullptr, 0);
        SetVariant(0);
        FreeFwd(fv);
        vo = Compare16(ov.out, R.out, P.dt);
        vl = CompareLse(ov.lse, R.lse);
      }
      if (v <= nb) {
        SetVariant(v);
        RunBackwardDevice(P, in, f, &ov, nullptr, 0);
        SetVariant(0);
        vq = Compare16(ov.dq, R.dq, P.dt);
        vk = Compare16(ov.dk, R.dk, P.dt);
        vv = Compare16(ov.dv, R.dv, P.dt);
        if (checks_dbias) vb = Compare16(ov.dbias, R.dbias, P.dt);
      }
      const bool vnan = vo.nan || vl.nan || vq.nan || vk.nan || vv.nan || vb.nan;
      const bool vok = !vnan && vo.rel <= 1e-2 && vl.rel <= 5e-2 && vq.rel <= 2e-2 &&
                       vk.rel <= 2e-2 && vv.rel <= 2e-2 && vb.rel <= 2e-2;
      if (!vok) ++variant_failures;
      char buf[256];
      std::snprintf(buf, sizeof(buf),
                    "  ^ variant %d (fwd %s, bwd %s)   %8.1e %8.1e %8.1e %8.1e %8.1e %8.1e %5s "
                    "%s\n",
                    v, v <= nf ? "yes" : "-", v <= nb ? "yes" : "-", vo.rel, vl.rel, vq.rel, vk.rel,
                    vv.rel, vb.rel, "-", vok ? "PASS" : (vnan ? "FAIL (NaN/inf)" : "FAIL"));
      vlines += buf;
    }
    FreeFwd(f);
    FreeInputs(in);
    Err eq = Worse(Compare16(o.dq, R.dq, P.dt), Compare16(plain.dq, R.dq, P.dt));
    Err ek = Worse(Compare16(o.dk, R.dk, P.dt), Compare16(plain.dk, R.dk, P.dt));
    Err ev = Worse(Compare16(o.dv, R.dv, P.dt), Compare16(plain.dv, R.dv, P.dt));
    Err eb;
    if (checks_dbias) {
      eb = Worse(Compare16(o.dbias, R.dbias, P.dt), Compare16(plain.dbias, R.dbias, P.dt));
    }
    if (c.gate) {  // the dbias column: with a gate, the worst of dbias, dalpha and ddelta
      for (const DeviceOut* d : {&o, &plain}) {
        eb = Worse(eb, Worse(Compare32(d->dalpha, R.dalpha), Compare32(d->ddelta, R.ddelta)));
      }
    }
    if (flash2_bwd) {
      eq = Worse(eq, Compare16(flash2.dq, R.dq, P.dt));
      ek = Worse(ek, Compare16(flash2.dk, R.dk, P.dt));
      ev = Worse(ev, Compare16(flash2.dv, R.dv, P.dt));
      if (checks_dbias) eb = Worse(eb, Compare16(flash2.dbias, R.dbias, P.dt));
    }
    const bool nan = eo.nan || el.nan || eq.nan || ek.nan || ev.nan || eb.nan;
    const bool ok = !nan && zero_ok && det_ok && paged_ok && eo.rel <= 1e-2 && el.rel <= 5e-2 &&
                    eq.rel <= 2e-2 && ek.rel <= 2e-2 && ev.rel <= 2e-2 && eb.rel <= 2e-2;
    if (!ok) ++failures;
    std::printf("%8.1e %8.1e %8.1e %8.1e %5s %s%s%s%s\n", eq.rel, ek.rel, ev.rel, eb.rel,
                c.deterministic ? (det_ok ? "yes" : "NO") : "-", ok ? "PASS" : "FAIL",
                nan ? " (NaN/inf)" : "", zero_ok ? "" : " (masked row not zero)",
                paged_ok ? (decode ? " (paged: same bits)" : "") : " (paged cache differs)");
    if (!ok) {
      const int64_t qrow = c.H * c.D, kvrow = c.Hk * c.D;
      if (eo.rel > 1e-2 || eo.nan) Worst("out", o.out, R.out, P.dt, qrow, c.H, c.D);
      if (eq.rel > 2e-2 || eq.nan) Worst("dq", o.dq, R.dq, P.dt, qrow, c.H, c.D);
      if (ek.rel > 2e-2 || ek.nan) Worst("dk", o.dk, R.dk, P.dt, kvrow, c.Hk, c.D);
      if (ev.rel > 2e-2 || ev.nan) Worst("dv", o.dv, R.dv, P.dt, kvrow, c.Hk, c.D);
      if (eb.rel > 2e-2 || eb.nan) {
        const int64_t cols = c.bias.cols ? c.Lk : 1;
        Worst("dbias", o.dbias, R.dbias, P.dt, cols, 1, cols);
      }
      if (el.nan || el.rel > 5e-2) {
        for (size_t i = 0; i < R.lse.size(); ++i) {
          const bool bad = std::isinf(R.lse[i]) ? !(std::isinf(o.lse[i]) && o.lse[i] < 0)
                                                : !(std::fabs(o.lse[i] - R.lse[i]) <= 5e-2);
          if (bad) {
            std::printf("    first bad lse at flat %zu ([b,h] row %zu, i %zu): got %g ref %g\n",
                        i, i / c.Lq, i % c.Lq, o.lse[i], R.lse[i]);
            break;
          }
        }
      }
    }
    std::printf("%s", vlines.c_str());
    std::fflush(stdout);
  }
  if (!bench_only && only.empty() && (exact.empty() || exact == "dynamic_kernels")) {
    ++ran;
    if (!DynamicKernelChecks()) ++failures;
  }
  if (!bench_only && only.empty() && (exact.empty() || exact == "scale_refusals")) {
    ++ran;
    if (!ScaleRefusals()) ++failures;
  }
  if (variants) std::printf("variant failures: %d\n", variant_failures);
  if (bench) {
    Bench(variants, only);
    if (only.empty()) BenchSplits();
  }
  std::printf("\n%d case(s) run, %d failed\n", ran, failures);
  return failures ? 1 : 0;
}
