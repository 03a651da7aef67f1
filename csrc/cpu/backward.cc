// Backward, deterministic and without atomics, in three passes:
//   0. softmax_d = rowsum(dout ∘ out) - dlse, per (batch, head);
//   1. dk, dv, dbias: one task per (owner group, key block) loops over the query blocks and the
//      group's items, summing into fp32 tiles it alone owns, then writes them once;
//   2. dq: one task per (batch, head, query block) loops over the key blocks.
// With a gate, pass 1 also sums ddelta (per kv head: the group's items share it) and pass 2
// dalpha (per row), each from dS ∘ sigmoid(-alpha·delta) of the tiles they already visit.
// Both gradient passes recompute P and dS tile by tile and skip the tiles the forward skips.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/attention.h"
#include "cpu/dbias_accumulator.h"
#include "cpu/element_types.h"
#include "cpu/fast_math.h"
#include "cpu/gemm.h"
#include "cpu/ownership.h"
#include "cpu/scores.h"
#include "cpu/scratch.h"
#include "cpu/simd.h"
#include "cpu/tile_loads.h"
#include "cpu/tiles.h"

namespace dmattn::cpu {
namespace {

// The operands of one call with their element type; dbias is null without a bias.
template <typename T>
struct Operands {
  Operands(const AttentionShape& shape, const BackwardArgs& a)
      : q(static_cast<const T*>(a.q)),
        k(static_cast<const T*>(a.k)),
        v(static_cast<const T*>(a.v)),
        dout(static_cast<const T*>(a.dout)),
        bias(static_cast<const T*>(a.bias)),
        dq(static_cast<T*>(a.dq)),
        dk(static_cast<T*>(a.dk)),
        dv(static_cast<T*>(a.dv)),
        dbias(shape.bias.present && shape.dbias.present ? static_cast<T*>(a.dbias) : nullptr) {}
  const T *q, *k, *v, *dout, *bias;
  T *dq, *dk, *dv, *dbias;
};

// Pass 0 for one (batch, head): softmax_d[i] = dout_i · out_i - dlse_i.
template <typename T>
void ComputeSoftmaxD(const AttentionShape& shape, const BackwardArgs& args, int64_t b,
                     int64_t h) {
  const Operands<T> ops(shape, args);
  const int64_t q_offset = shape.q_offset(b, h), lse_offset = shape.lse_offset(b, h);
  for (int64_t i = 0; i < shape.seqlen_q; ++i) {
    const int64_t row = q_offset + i * shape.q_row_stride();
    const T* g = ops.dout + row;
    float dot = 0.f;
    if (args.out_f32) {
      const float* o = static_cast<const float*>(args.out) + row;
      for (int64_t d = 0; d < shape.head_dim; ++d) dot += ToFloat(g[d]) * o[d];
    } else {
      const T* o = static_cast<const T*>(args.out) + row;
      for (int64_t d = 0; d < shape.head_dim; ++d) dot += ToFloat(g[d]) * ToFloat(o[d]);
    }
    const float dlse = args.dlse != nullptr ? args.dlse[lse_offset + i] : 0.f;
    args.softmax_d[lse_offset + i] = dot - dlse;
  }
}

// The fp32 tiles of one (item, query block) and of its score gradients.
struct GradTiles {
  GradTiles(int64_t dp, bool softcap, bool gate)
      : q(AllocateFloats(kBlockM * dp)),
        dout(AllocateFloats(kBlockM * dp)),
        lse(AllocateFloats(kBlockM)),
        delta(AllocateFloats(kBlockM)),
        s(AllocateFloats(kBlockM * kBlockN)),
        ds(AllocateFloats(kBlockM * kBlockN)),
        cap_grad(softcap ? AllocateFloats(kBlockM * kBlockN) : nullptr),
        gate_grad(gate ? AllocateFloats(kBlockM * kBlockN) : nullptr) {}
  FloatBuffer q;         // [kBlockM][dp], multiplied by the scale
  FloatBuffer dout;      // [kBlockM][dp]
  FloatBuffer lse;       // per row; -inf in padding rows
  FloatBuffer delta;     // softmax_d per row; 0 in padding rows
  FloatBuffer s;         // [kBlockM][kBlockN]: scores, then P
  FloatBuffer ds;        // [kBlockM][kBlockN]: dP, then dS
  FloatBuffer cap_grad;  // [kBlockM][kBlockN]: 1 - tanh², only with softcap
  FloatBuffer gate_grad;  // [kBlockM][kBlockN]: sigmoid(-alpha·delta), only with a gate
};

// Loads the query side of tile t: its rows of q (scaled), dout, lse and softmax_d.
template <typename T>
void LoadQuerySide(const AttentionShape& shape, const BackwardArgs& args, const Operands<T>& ops,
                   const HeadItem& item, const Tile& t, GradTiles& tiles) {
  const int64_t dp = PaddedHeadDim(shape), stride = shape.q_row_stride();
  const int64_t first = item.q_offset + t.i0 * stride;
  LoadRows(ops.q + first, stride, t.rows, shape.head_dim, shape.scale, tiles.q.get(), dp,
           t.padded_rows());
  LoadRows(ops.dout + first, stride, t.rows, shape.head_dim, 1.f, tiles.dout.get(), dp,
           t.padded_rows());
  for (int64_t r = 0; r < t.padded_rows(); ++r) {
    const bool real = r < t.rows;
    tiles.lse[r] = real ? args.lse[item.lse_offset + t.i0 + r] : -INFINITY;
    tiles.delta[r] = real ? args.softmax_d[item.lse_offset + t.i0 + r] : 0.f;
  }
}

// tiles.s <- P = exp(scores - lse) and tiles.ds <- dS = P ∘ (dout·vᵀ - D) ∘ softcap' for tile t,
// from the loaded query side and the key-minor K and V tiles kt, vt.
template <typename T>
void ComputeScoreGrads(const AttentionShape& shape, const HeadItem& item, const bool* mask,
                       const T* bias, const Tile& t, const float* kt, const float* vt,
                       GradTiles& tiles) {
  const int64_t dp = PaddedHeadDim(shape), rows = t.padded_rows(), cols = t.padded_cols();
  ComputeScores(shape, item, mask, bias, t, tiles.q.get(), dp, kt, tiles.s.get(),
                tiles.cap_grad.get(), tiles.gate_grad.get());
  for (int64_t r = 0; r < rows; ++r) std::fill_n(tiles.ds.get() + r * kBlockN, cols, 0.f);
  GemmAccumulate(rows, cols, shape.head_dim, tiles.dout.get(), dp, 1, vt, kBlockN,
                 tiles.ds.get(), kBlockN);
  for (int64_t r = 0; r < rows; ++r) {
    // A row with no visible key has lse = -inf and P = 0: shifting by +inf gives exp(-inf) = 0.
    const float shift = tiles.lse[r] == -INFINITY ? INFINITY : tiles.lse[r];
    const float delta = tiles.delta[r];
    float* __restrict p = tiles.s.get() + r * kBlockN;
    float* __restrict ds = tiles.ds.get() + r * kBlockN;
    for (int64_t c = 0; c < cols; ++c) {
      p[c] = FastExp(p[c] - shift);
      ds[c] = p[c] * (ds[c] - delta);
    }
    if (tiles.cap_grad != nullptr) {
      const float* __restrict g = tiles.cap_grad.get() + r * kBlockN;
      for (int64_t c = 0; c < cols; ++c) ds[c] *= g[c];
    }
  }
}

// Writes rows [0, rows) of an fp32 tile (row stride ld), times `scale`, into an operand whose
// rows are row_stride apart.
template <typename T>
void StoreRows(const float* src, int64_t ld, int64_t rows, int64_t dim, float scale, T* dst,
               int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d)
      dst[r * row_stride + d] = FromFloat<T>(scale * src[r * ld + d]);
}

// ddelta[c] += sum over the tile's rows of dS[r][c] · sigmoid(-alpha_r·delta_c) · alpha_r.
inline void AddGateKeyGrads(const AttentionShape& shape, const HeadItem& item, const Tile& t,
                            const GradTiles& tiles, float* ddelta) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const float a = item.alpha[(t.i0 + r) * shape.num_heads];
    const float* __restrict ds = tiles.ds.get() + r * kBlockN;
    const float* __restrict g = tiles.gate_grad.get() + r * kBlockN;
    for (int64_t c = 0; c < t.cols; ++c) ddelta[c] += ds[c] * g[c] * a;
  }
}

// dalpha[r] += sum over the tile's keys of dS[r][c] · sigmoid(-alpha_r·delta_c) · delta_c.
inline void AddGateRowGrads(const AttentionShape& shape, const HeadItem& item, const Tile& t,
                            const GradTiles& tiles, float* dalpha) {
  const float* __restrict d = item.delta + t.j0 * shape.num_kv_heads;
  for (int64_t r = 0; r < t.rows; ++r) {
    const float* __restrict ds = tiles.ds.get() + r * kBlockN;
    const float* __restrict g = tiles.gate_grad.get() + r * kBlockN;
    float sum = 0.f;
    for (int64_t c = 0; c < t.cols; ++c) sum += ds[c] * g[c] * d[c * shape.num_kv_heads];
    dalpha[r] += sum;
  }
}

// Pass 1 state of an owner group in one key block: the block's K and V tiles (key-minor) of each
// distinct k/v source, loaded on first use, and the fp32 dk and dv sums of each distinct target.
template <typename T>
class KeyBlockTiles {
 public:
  KeyBlockTiles(const AttentionShape& shape, const Operands<T>& ops, const OwnerGroup& group)
      : shape_(shape),
        ops_(ops),
        sources_(group.kv.offsets),
        targets_(group.dkv.offsets),
        dp_(PaddedHeadDim(shape)),
        kt_(AllocateFloats(sources_.size() * dp_ * kBlockN)),
        vt_(AllocateFloats(sources_.size() * dp_ * kBlockN)),
        dk_(AllocateFloats(targets_.size() * kBlockN * dp_)),
        dv_(AllocateFloats(targets_.size() * kBlockN * dp_)),
        loaded_(sources_.size()) {}

  void BeginKeyBlock(int64_t kb) {
    j0_ = kb * kBlockN;
    cols_ = std::min(kBlockN, shape_.seqlen_k - j0_);
    std::fill_n(dk_.get(), targets_.size() * kBlockN * dp_, 0.f);
    std::fill_n(dv_.get(), targets_.size() * kBlockN * dp_, 0.f);
    std::fill(loaded_.begin(), loaded_.end(), false);
  }

  // The K and V tiles of a source: every key of the block, whatever an item's kv_len (the items
  // reading it may see different lengths).
  const float* kt(int64_t source) {
    Load(source);
    return kt_.get() + source * dp_ * kBlockN;
  }
  const float* vt(int64_t source) {
    Load(source);
    return vt_.get() + source * dp_ * kBlockN;
  }
  float* dk(int64_t target) { return dk_.get() + target * kBlockN * dp_; }
  float* dv(int64_t target) { return dv_.get() + target * kBlockN * dp_; }

  void EndKeyBlock() {
    const int64_t stride = shape_.kv_row_stride();
    for (size_t target = 0; target < targets_.size(); ++target) {
      const int64_t first = targets_[target] + j0_ * stride;
      StoreRows(dk(target), dp_, cols_, shape_.head_dim, 1.f, ops_.dk + first, stride);
      StoreRows(dv(target), dp_, cols_, shape_.head_dim, 1.f, ops_.dv + first, stride);
    }
  }

 private:
  void Load(int64_t source) {
    if (loaded_[source]) return;
    const int64_t stride = shape_.kv_row_stride(), first = sources_[source] + j0_ * stride;
    const int64_t padded = RoundUp(cols_, kVecWidth);
    LoadTransposed(ops_.k + first, stride, cols_, shape_.head_dim,
                   kt_.get() + source * dp_ * kBlockN, kBlockN, padded);
    LoadTransposed(ops_.v + first, stride, cols_, shape_.head_dim,
                   vt_.get() + source * dp_ * kBlockN, kBlockN, padded);
    loaded_[source] = true;
  }

  const AttentionShape& shape_;
  const Operands<T>& ops_;
  const std::vector<int64_t>& sources_;
  const std::vector<int64_t>& targets_;
  const int64_t dp_;
  FloatBuffer kt_, vt_, dk_, dv_;
  std::vector<bool> loaded_;
  int64_t j0_ = 0, cols_ = 0;
};

// Pass 1: dk, dv and dbias of one owner group over key blocks [kb_begin, kb_end).
template <typename T>
void KeyBlockTask(const AttentionShape& shape, const BackwardArgs& args, const OwnerGroup& group,
                  int64_t kb_begin, int64_t kb_end) {
  const Operands<T> ops(shape, args);
  const int64_t dp = PaddedHeadDim(shape);
  std::vector<HeadItem> items;
  for (const int64_t item : group.items)
    items.push_back(MakeHeadItem(shape, args, item / shape.num_heads,
                                 item % shape.num_heads));
  KeyBlockTiles<T> kv(shape, ops, group);
  DbiasAccumulator<T> dbias(shape, ops.dbias, group.dbias.offsets);
  GradTiles tiles(dp, shape.softcap > 0.f, shape.has_gate);
  // ddelta of each distinct (batch, kv head) of the group: the items sharing one share its dk
  // target, so this group alone writes it.
  Slots ddelta_slots;
  if (shape.has_gate) {
    for (const int64_t item : group.items) {
      const int64_t b = item / shape.num_heads, h = item % shape.num_heads;
      const int64_t offset = shape.delta_offset(b, h / shape.heads_per_kv_head());
      const auto found = std::find(ddelta_slots.offsets.begin(), ddelta_slots.offsets.end(),
                                   offset);
      ddelta_slots.of_item.push_back(static_cast<int>(found - ddelta_slots.offsets.begin()));
      if (found == ddelta_slots.offsets.end()) ddelta_slots.offsets.push_back(offset);
    }
  }
  std::vector<float> ddelta(ddelta_slots.offsets.size() * kBlockN);

  const int64_t q_blocks = NumBlocks(shape.seqlen_q, kBlockM);
  dbias.BeginTask();
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    kv.BeginKeyBlock(kb);
    dbias.BeginKeyBlock(kb);
    std::fill(ddelta.begin(), ddelta.end(), 0.f);
    for (int64_t qb = 0; qb < q_blocks; ++qb) {
      dbias.BeginQueryBlock(qb);
      for (size_t n = 0; n < items.size(); ++n) {
        const HeadItem& item = items[n];
        const bool* mask = args.mask != nullptr ? args.mask + item.mask_offset : nullptr;
        const Tile t = MakeTile(item, qb, kb);
        if (!TileHasVisibleKey(shape, item, mask, t)) continue;
        const int64_t source = group.kv.of_item[n], target = group.dkv.of_item[n];
        LoadQuerySide(shape, args, ops, item, t, tiles);
        const T* bias = ops.bias != nullptr ? ops.bias + item.bias_offset : nullptr;
        ComputeScoreGrads(shape, item, mask, bias, t, kv.kt(source), kv.vt(source), tiles);
        // dv += Pᵀ·dout and dk += dSᵀ·(scale·q): A is read transposed from the [row][key] tiles.
        GemmAccumulate(t.padded_cols(), dp, t.rows, tiles.s.get(), 1, kBlockN, tiles.dout.get(),
                       dp, kv.dv(target), dp);
        GemmAccumulate(t.padded_cols(), dp, t.rows, tiles.ds.get(), 1, kBlockN, tiles.q.get(), dp,
                       kv.dk(target), dp);
        dbias.Add(group.dbias.of_item[n], t, tiles.ds.get());
        if (shape.has_gate)
          AddGateKeyGrads(shape, item, t, tiles,
                          ddelta.data() + ddelta_slots.of_item[n] * kBlockN);
      }
      dbias.EndQueryBlock();
    }
    kv.EndKeyBlock();
    dbias.EndKeyBlock();
    const int64_t j0 = kb * kBlockN, cols = std::min(kBlockN, shape.seqlen_k - j0);
    for (size_t slot = 0; slot < ddelta_slots.offsets.size(); ++slot)
      for (int64_t c = 0; c < cols; ++c)
        args.ddelta[ddelta_slots.offsets[slot] + (j0 + c) * shape.num_kv_heads] =
            ddelta[slot * kBlockN + c];
  }
  dbias.EndTask();
}

// Pass 2: dq of one (batch, head, query block).
template <typename T>
void QueryBlockTask(const AttentionShape& shape, const BackwardArgs& args, int64_t b, int64_t h,
                    int64_t qb) {
  const Operands<T> ops(shape, args);
  const HeadItem item = MakeHeadItem(shape, args, b, h);
  const int64_t dim = shape.head_dim, dp = PaddedHeadDim(shape);
  const int64_t q_stride = shape.q_row_stride(), kv_stride = shape.kv_row_stride();
  const bool* mask = args.mask != nullptr ? args.mask + item.mask_offset : nullptr;
  const T* bias = ops.bias != nullptr ? ops.bias + item.bias_offset : nullptr;

  GradTiles tiles(dp, shape.softcap > 0.f, shape.has_gate);
  FloatBuffer kt = AllocateFloats(dp * kBlockN), vt = AllocateFloats(dp * kBlockN);
  FloatBuffer k = AllocateFloats(kBlockN * dp), dq = AllocateFloats(kBlockM * dp);
  std::fill_n(dq.get(), kBlockM * dp, 0.f);
  float dalpha[kBlockM] = {};

  const Tile block = MakeTile(item, qb, 0);  // its rows; the keys vary per tile
  if (block.rows > 0) {
    LoadQuerySide(shape, args, ops, item, block, tiles);
    const Range keys = VisibleKeysOfRows(shape, item, block.i0, block.rows);
    const int64_t kb_end = keys.empty() ? 0 : NumBlocks(keys.end, kBlockN);
    for (int64_t kb = keys.begin / kBlockN; kb < kb_end; ++kb) {
      const Tile t = MakeTile(item, qb, kb);
      if (!TileHasVisibleKey(shape, item, mask, t)) continue;
      const int64_t first = item.kv_offset + t.j0 * kv_stride;
      LoadTransposed(ops.k + first, kv_stride, t.cols, dim, kt.get(), kBlockN, t.padded_cols());
      LoadTransposed(ops.v + first, kv_stride, t.cols, dim, vt.get(), kBlockN, t.padded_cols());
      LoadRows(ops.k + first, kv_stride, t.cols, dim, 1.f, k.get(), dp, t.cols);
      ComputeScoreGrads(shape, item, mask, bias, t, kt.get(), vt.get(), tiles);
      GemmAccumulate(t.padded_rows(), dp, t.cols, tiles.ds.get(), kBlockN, 1, k.get(), dp,
                     dq.get(), dp);
      if (shape.has_gate) AddGateRowGrads(shape, item, t, tiles, dalpha);
    }
  }
  // dq = scale · dS·k; rows past q_len and rows with no visible key keep their zeros.
  const int64_t block_rows = std::min(kBlockM, shape.seqlen_q - block.i0);
  StoreRows(dq.get(), dp, block_rows, dim, shape.scale,
            ops.dq + item.q_offset + block.i0 * q_stride, q_stride);
  if (shape.has_gate) {
    float* out = args.dalpha + shape.alpha_offset(b, h);
    for (int64_t r = 0; r < block_rows; ++r) out[(block.i0 + r) * shape.num_heads] = dalpha[r];
  }
}

}  // namespace

void Backward(const AttentionShape& shape, const BackwardArgs& args,
              const ParallelFor& parallel_for) {
  const int64_t heads = shape.num_heads, items = shape.batch_count() * heads;
  const int64_t q_blocks = NumBlocks(shape.seqlen_q, kBlockM);
  const int64_t kv_blocks = NumBlocks(shape.seqlen_k, kBlockN);
  DispatchElementType(shape.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    parallel_for(items, [&](int64_t item) {
      ComputeSoftmaxD<T>(shape, args, item / heads, item % heads);
    });

    // A dbias broadcast over keys sums dS over every key into one element per row, so a task
    // that owns it must span all key blocks.
    const std::vector<OwnerGroup> groups = PartitionIntoOwnerGroups(shape);
    const int64_t group_count = static_cast<int64_t>(groups.size());
    const bool whole_rows = shape.dbias.present && shape.dbias.broadcast_over_cols();
    const int64_t chunks = whole_rows ? 1 : kv_blocks;
    // First key blocks first: under a causal rule they are seen by the most queries.
    parallel_for(group_count * chunks, [&](int64_t task) {
      const OwnerGroup& group = groups[task % group_count];
      const int64_t chunk = task / group_count;
      if (whole_rows) {
        KeyBlockTask<T>(shape, args, group, 0, kv_blocks);
      } else {
        KeyBlockTask<T>(shape, args, group, chunk, chunk + 1);
      }
    });

    parallel_for(items * q_blocks, [&](int64_t task) {
      const int64_t qb = q_blocks - 1 - task / items, item = task % items;
      QueryBlockTask<T>(shape, args, item / heads, item % heads, qb);
    });
  });
}

}  // namespace dmattn::cpu
