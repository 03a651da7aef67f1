// dbias of one backward pass-1 task (an owner group over one or all key blocks): dS summed in
// fp32, in a fixed order, over the items of the group and over the rows and/or columns the dbias
// operand broadcasts over (its own layout, shape.dbias); each dbias element is written once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/params.h"
#include "cpu/element_types.h"
#include "cpu/scratch.h"
#include "cpu/simd.h"
#include "cpu/tiles.h"

namespace dmattn::cpu {

template <typename T>
class DbiasAccumulator {
 public:
  // slot_offsets: dbias.offset of each distinct dbias entry (batch, head) of the group. With a
  // null dbias (no bias) every call does nothing.
  DbiasAccumulator(const AttentionShape& shape, T* dbias, const std::vector<int64_t>& slot_offsets)
      : shape_(shape),
        layout_(shape.dbias),
        dbias_(dbias),
        slot_offsets_(slot_offsets),
        window_(WindowOf(shape.dbias)),
        slot_size_(window_ == kTask ? (layout_.broadcast_over_rows() ? 1 : shape.seqlen_q)
                                    : (window_ == kKeyBlock ? kBlockN : kBlockM * kBlockN)),
        acc_(AllocateFloats(dbias != nullptr ? slot_offsets.size() * slot_size_ : 0)) {}

  // The task calls these around its loops. Each window of sums is zeroed when it opens and
  // written when it closes; which loop level opens it depends on the broadcast:
  //   over columns: one window for the whole task (every row, or the single row);
  //   over rows only: one per key block (its columns of the single row);
  //   neither: one per (key block, query block) tile.
  void BeginTask() {
    if (window_ == kTask) Open(0, layout_.broadcast_over_rows() ? 1 : shape_.seqlen_q, 0, 1);
  }
  void EndTask() {
    if (window_ == kTask) Close();
  }
  void BeginKeyBlock(int64_t kb) {
    j0_ = kb * kBlockN;
    block_cols_ = std::min(kBlockN, shape_.seqlen_k - j0_);
    if (window_ == kKeyBlock) Open(0, 1, j0_, block_cols_);
  }
  void EndKeyBlock() {
    if (window_ == kKeyBlock) Close();
  }
  void BeginQueryBlock(int64_t qb) {
    const int64_t i0 = qb * kBlockM;
    if (window_ == kTile) Open(i0, std::min(kBlockM, shape_.seqlen_q - i0), j0_, block_cols_);
  }
  void EndQueryBlock() {
    if (window_ == kTile) Close();
  }

  // Adds the tile's dS (row stride kBlockN; zero outside the visible rows × cols) to a slot.
  void Add(int64_t slot, const Tile& t, const float* ds) {
    if (dbias_ == nullptr) return;
    float* acc = acc_.get() + slot * slot_size_;
    if (layout_.broadcast_over_rows()) {
      // Sum the tile's rows first and add the result once: one rounding at the running total
      // per tile instead of one per row.
      float col_sums[kBlockN] = {};
      for (int64_t r = 0; r < t.rows; ++r)
        for (int64_t c = 0; c < t.padded_cols(); ++c) col_sums[c] += ds[r * kBlockN + c];
      AddRow(col_sums, t, acc - row0_ * cols_);
    } else {
      for (int64_t r = 0; r < t.rows; ++r)
        AddRow(ds + r * kBlockN, t, acc + (t.i0 + r - row0_) * cols_);
    }
  }

 private:
  enum Window { kTask, kKeyBlock, kTile };
  static Window WindowOf(const BroadcastOperand& bias) {
    if (bias.broadcast_over_cols()) return kTask;
    return bias.broadcast_over_rows() ? kKeyBlock : kTile;
  }

  // Adds one row of dS (the tile's padded columns) to the window row `acc`.
  void AddRow(const float* d, const Tile& t, float* acc) const {
    if (layout_.broadcast_over_cols()) {
      acc[0] += RowSum(d, t.padded_cols());
    } else {
      for (int64_t c = 0; c < t.cols; ++c) acc[t.j0 - col0_ + c] += d[c];
    }
  }

  // Starts sums over dbias rows [row0, row0 + rows) × columns [col0, col0 + cols), in its own
  // coordinates (query i is row i, or 0 when broadcast; likewise for keys).
  void Open(int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
    if (dbias_ == nullptr) return;
    row0_ = row0;
    rows_ = rows;
    col0_ = col0;
    cols_ = cols;
    std::fill(acc_.get(), acc_.get() + slot_offsets_.size() * slot_size_, 0.f);
  }

  void Close() const {
    if (dbias_ == nullptr) return;
    for (size_t slot = 0; slot < slot_offsets_.size(); ++slot) {
      const float* acc = acc_.get() + slot * slot_size_;
      T* out = dbias_ + slot_offsets_[slot];
      for (int64_t r = 0; r < rows_; ++r)
        for (int64_t c = 0; c < cols_; ++c)
          out[(row0_ + r) * layout_.row_stride + (col0_ + c) * layout_.col_stride] =
              FromFloat<T>(acc[r * cols_ + c]);
    }
  }

  const AttentionShape& shape_;
  const BroadcastOperand& layout_;  // the dbias operand's layout
  T* const dbias_;
  const std::vector<int64_t>& slot_offsets_;
  const Window window_;
  const int64_t slot_size_;
  FloatBuffer acc_;
  int64_t j0_ = 0, block_cols_ = 0;  // the current key block
  int64_t row0_ = 0, rows_ = 0, col0_ = 0, cols_ = 0;  // the open window
};

}  // namespace dmattn::cpu
