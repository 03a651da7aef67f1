// The score tile, computed identically by the forward and both backward passes, so that the
// backward recomputes exactly the forward's scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "cpu/element_types.h"
#include "cpu/fast_math.h"
#include "cpu/gemm.h"
#include "cpu/tiles.h"

namespace dmattn::cpu {

// s[r][c] <- the tile's bias (0 without one) over t.padded_rows() × t.padded_cols(), so that the
// product Q·Kᵀ accumulates onto it; 0 outside the visible rows × cols.
template <typename T>
void InitScoresFromBias(const AttentionShape& shape, const T* item_bias, const Tile& t,
                        float* s) {
  for (int64_t r = 0; r < t.padded_rows(); ++r) {
    float* __restrict srow = s + r * kBlockN;
    int64_t c = 0;
    if (item_bias != nullptr && r < t.rows) {
      const T* __restrict b = OperandRow(item_bias, shape.bias, t, r);
      const int64_t stride = shape.bias.col_stride;
      if (stride == 1) {
        for (; c < t.cols; ++c) srow[c] = ToFloat(b[c]);
      } else {
        for (; c < t.cols; ++c) srow[c] = ToFloat(b[c * stride]);
      }
    }
    for (; c < t.padded_cols(); ++c) srow[c] = 0.f;
  }
}

// s[r][c] += logsigmoid(alpha_r * delta_c) over the visible rows × cols (the gate of gated
// attention); gate_grad (if not null) <- its derivative sigmoid(-alpha_r * delta_c) there and 0
// elsewhere in t.padded_rows() × t.padded_cols().
inline void AddGate(const AttentionShape& shape, const HeadItem& item, const Tile& t, float* s,
                    float* gate_grad) {
  const int64_t a_stride = shape.num_heads, d_stride = shape.num_kv_heads;
  for (int64_t r = 0; r < t.padded_rows(); ++r) {
    float* __restrict srow = s + r * kBlockN;
    float* __restrict grow = gate_grad != nullptr ? gate_grad + r * kBlockN : nullptr;
    int64_t c = 0;
    if (r < t.rows) {
      const float a = item.alpha[(t.i0 + r) * a_stride];
      const float* __restrict d = item.delta + t.j0 * d_stride;
      for (; c < t.cols; ++c) {
        const float x = a * d[c * d_stride];
        // logsigmoid(x) = min(x, 0) - log1p(e^-|x|); sigmoid(-x) = e^-|x| / (1 + e^-|x|) for
        // x >= 0, 1 / (1 + e^-|x|) below: no cancellation on either side.
        const float e = std::exp(-std::fabs(x));
        srow[c] += std::fmin(x, 0.f) - std::log1p(e);
        if (grow != nullptr) grow[c] = (x >= 0.f ? e : 1.f) / (1.f + e);
      }
    }
    if (grow != nullptr)
      for (; c < t.padded_cols(); ++c) grow[c] = 0.f;
  }
}

// s <- softcap · tanh(s / softcap); cap_grad (if not null) <- the derivative 1 - tanh².
inline void ApplySoftcap(float softcap, const Tile& t, float* s, float* cap_grad) {
  const float inv_cap = 1.f / softcap;
  for (int64_t r = 0; r < t.padded_rows(); ++r) {
    float* __restrict srow = s + r * kBlockN;
    for (int64_t c = 0; c < t.padded_cols(); ++c) srow[c] = FastTanh(srow[c] * inv_cap);
    if (cap_grad != nullptr) {
      float* __restrict grow = cap_grad + r * kBlockN;
      for (int64_t c = 0; c < t.padded_cols(); ++c) grow[c] = 1.f - srow[c] * srow[c];
    }
    for (int64_t c = 0; c < t.padded_cols(); ++c) srow[c] *= softcap;
  }
}

// listed[c] <- whether tile column c's key block is listed for query block n, c in [0, t.cols):
// each listed block marks its part of the tile in a difference array (duplicates add, -1 and
// out-of-range entries mark nothing), so O(K + cols) however wide the blocks are.
inline void ListedTileCols(const AttentionShape& shape, const HeadItem& item, const Tile& t,
                           int64_t n, uint8_t* listed) {
  int32_t delta[kBlockN + 1] = {};
  const int32_t* blocks = ListedKeyBlocks(shape, item, n);
  for (int64_t s = 0; s < shape.block_slots; ++s) {
    const int64_t m = blocks[s];
    const int64_t lo = std::max<int64_t>(m * shape.block_k - t.j0, 0);
    const int64_t hi = std::min<int64_t>((m + 1) * shape.block_k - t.j0, t.cols);
    if (lo < hi) {
      ++delta[lo];
      --delta[hi];
    }
  }
  int32_t covering = 0;
  for (int64_t c = 0; c < t.cols; ++c) {
    covering += delta[c];
    listed[c] = covering > 0;
  }
}

// s[r][c] <- -inf where key c is not visible to row r: outside the diagonal/window rule or the
// kv head's window and sink, past q_len / kv_len, in another segment, outside the key's range or
// the row's range, in a key block the row's query block does not list, or masked out.
inline void HideInvisibleScores(const AttentionShape& shape, const HeadItem& item,
                                const bool* item_mask, const Tile& t, float* s) {
  uint8_t listed[kBlockN];
  int64_t listed_for = -1;  // the query block `listed` was made for (rows share their block's)
  for (int64_t r = 0; r < t.padded_rows(); ++r) {
    float* __restrict srow = s + r * kBlockN;
    const RowKeys keys = r < t.rows ? RowVisibleCols(shape, item, t, r) : RowKeys{};
    // The later rules only narrow the row within `vis`; keys between a sink and its band are
    // hidden here already.
    const Range vis = keys.hull();
    for (int64_t c = 0; c < t.padded_cols(); ++c)
      srow[c] = (c >= vis.begin && c < vis.end) ? srow[c] : -INFINITY;
    for (int64_t c = keys.low.end; c < keys.high.begin; ++c) srow[c] = -INFINITY;
    if (item.q_segments != nullptr && !vis.empty()) {
      const int32_t segment = item.q_segments[t.i0 + r];
      const int32_t* __restrict keys = item.kv_segments + t.j0;
      for (int64_t c = vis.begin; c < vis.end; ++c)
        srow[c] = keys[c] == segment ? srow[c] : -INFINITY;
    }
    if (item.key_start != nullptr && !vis.empty()) {
      const int32_t i = static_cast<int32_t>(t.i0 + r);
      const int32_t* __restrict start = item.key_start + t.j0;
      const int32_t* __restrict end = item.key_end + t.j0;
      for (int64_t c = vis.begin; c < vis.end; ++c)
        srow[c] = (start[c] <= i && i < end[c]) ? srow[c] : -INFINITY;
    }
    if (item.row_start != nullptr && !vis.empty()) {
      // The row's range in tile columns: j = j0 + c is visible iff start <= j < end.
      const int64_t lo = item.row_start[t.i0 + r] - t.j0, hi = item.row_end[t.i0 + r] - t.j0;
      for (int64_t c = vis.begin; c < vis.end; ++c)
        srow[c] = (lo <= c && c < hi) ? srow[c] : -INFINITY;
    }
    if (item.block_indices != nullptr && !vis.empty()) {
      const int64_t n = (t.i0 + r) / shape.block_q;
      if (n != listed_for) {
        ListedTileCols(shape, item, t, n, listed);
        listed_for = n;
      }
      for (int64_t c = vis.begin; c < vis.end; ++c) srow[c] = listed[c] ? srow[c] : -INFINITY;
    }
    if (item_mask == nullptr || vis.empty()) continue;
    // Read as bytes: g++ vectorises this select, but not the same loop over bool.
    const uint8_t* m = reinterpret_cast<const uint8_t*>(OperandRow(item_mask, shape.mask, t, r));
    const int64_t stride = shape.mask.col_stride;
    if (stride == 1) {
      for (int64_t c = vis.begin; c < vis.end; ++c) srow[c] = m[c] != 0 ? srow[c] : -INFINITY;
    } else {
      for (int64_t c = vis.begin; c < vis.end; ++c)
        srow[c] = m[c * stride] != 0 ? srow[c] : -INFINITY;
    }
  }
}

// The tile's scores s[r][c] (row stride kBlockN) over t.padded_rows() × t.padded_cols():
// bias + q·kᵀ (q already multiplied by the scale, kt key-minor) + the gate, softcapped, then
// -inf where the key is not visible to the row. With softcap on and cap_grad not null, cap_grad
// receives the softcap's derivative; with a gate and gate_grad not null, gate_grad receives the
// gate's derivative (AddGate). item_mask / item_bias point at this item's (row 0, col 0), or
// are null.
template <typename T>
void ComputeScores(const AttentionShape& shape, const HeadItem& item, const bool* item_mask,
                   const T* item_bias, const Tile& t, const float* q, int64_t q_ld,
                   const float* kt, float* s, float* cap_grad, float* gate_grad = nullptr) {
  InitScoresFromBias(shape, item_bias, t, s);
  GemmAccumulate(t.padded_rows(), t.padded_cols(), shape.head_dim, q, q_ld, 1, kt, kBlockN, s,
                 kBlockN);
  if (item.alpha != nullptr) AddGate(shape, item, t, s, gate_grad);
  if (shape.softcap > 0.f) ApplySoftcap(shape.softcap, t, s, cap_grad);
  HideInvisibleScores(shape, item, item_mask, t, s);
}

}  // namespace dmattn::cpu
