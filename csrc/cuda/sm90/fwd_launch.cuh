// Host launcher of the warp-specialised Hopper forward (included by launch_template.cuh).
#pragma once

#include <cuda_runtime.h>

#include "cuda/launch.h"
#include "cuda/sm90/fwd_kernel.cuh"
#include "cuda/sm90/tensor_maps.h"

namespace dmattn::cuda::sm90 {

// The Hopper forward's tile of each head dim that has one (HasHopperForward in launch.h): at
// D = 64, three consumer warpgroups (192 query rows), whose softmax, relatively costlier than at
// larger head dims, hides under two others' GEMMs.
// Calls with a bias run the same tile with the bias and mask rings, calls with a mask alone with
// the mask ring only, calls with segment ids kernels that read them (D <= 128 all), calls with a
// window table kernels that read it (with a mask or bias, D <= 128), gated calls (D <= 128,
// without a mask, bias, segment ids or window table) kernels with the gate and two consumer
// warpgroups (128 query rows: the tiles nest in the gate threshold's grid), calls with a softmax
// threshold (D <= 128, without the gate, segment ids or a window table) kernels that apply it,
// with two consumer warpgroups (each a block of the rule's grid) and the operand rings where
// there is a mask or bias; calls with block indices of multiples of 64 x 64 (D <= 128, nothing
// else beside them: HopperForwardTakes) kernels that walk them, with two consumer warpgroups at
// every head dim (each one's 64 rows in one query block) and 64-key tiles where the key blocks
// are not multiples of 128.
template <int D>
struct FwdConfig {
  static constexpr bool kAvailable = HasHopperForward(D);
  static constexpr int kConsumers = D == 64 ? 3 : 2;
  using Traits = FwdTraits<D, D <= 128 ? 128 : 64, kConsumers>;
  using SegmentTraits = FwdTraits<D, D <= 128 ? 128 : 64, kConsumers, false, 0, 0, true>;
  using OperandTraits = FwdTraits<D, 128, kConsumers, true>;
  using MaskTraits = FwdTraits<D, 128, kConsumers, true, 0, 0, false, false>;
  using OperandSegmentTraits = FwdTraits<D, 128, kConsumers, true, 0, 0, true>;
  using TableTraits =
      FwdTraits<D, D <= 128 ? 128 : 64, kConsumers, false, 0, 0, false, false, true>;
  using OperandTableTraits = FwdTraits<D, 128, kConsumers, true, 0, 0, false, true, true>;
  using GateTraits =
      FwdTraits<D, D <= 128 ? 128 : 64, 2, false, 0, 0, false, false, false, true>;
  using ThresholdTraits = FwdTraits<D, 128, 2, false, 0, 0, false, false, false, false, true>;
  using ThresholdOperandTraits =
      FwdTraits<D, 128, 2, true, 0, 0, false, true, false, false, true>;
  template <int BN>
  using FormsTraits = FwdTraits<D, BN, 2, false, 0, 0, false, false, false, false, false, true>;
};

// Where the tiles of a mask or bias lie in its tensor map: its own contiguous shape [batch
// entries, head entries, rows, cols], a broadcast dim of size 1 (columns are never broadcast on
// this path: HopperForwardTakes).
struct OperandShape {
  int64_t batch_entries, head_entries, rows, cols;
  OperandTiles tiles;
};
inline OperandShape OperandShapeOf(const AttentionShape& s, const BroadcastOperand& op) {
  OperandShape o;
  o.tiles.per_head = op.head_stride != 0;
  o.tiles.one_row = op.row_stride == 0;
  o.head_entries = o.tiles.per_head ? s.num_heads / op.heads_per_entry : 1;
  o.tiles.head_entries = static_cast<int>(o.head_entries);
  o.rows = o.tiles.one_row ? 1 : s.seqlen_q;
  o.cols = s.seqlen_k;
  o.tiles.batch_entry_elems = o.head_entries * o.rows * o.cols;
  o.batch_entries = op.num_elements / o.tiles.batch_entry_elems;
  return o;
}

// The mask's bits (MaskBlockMap::bits) in boxes of box_rows x box_cols keys (one row when the
// mask is broadcast over queries); *tiles: where a kernel finds a tile's box.
inline cudaError_t EncodeMaskBitsMap(CUtensorMap* map, OperandTiles* tiles,
                                     const AttentionShape& s, const void* bits, int box_rows,
                                     int box_cols) {
  const OperandShape o = OperandShapeOf(s, s.mask);
  *tiles = o.tiles;
  return EncodeOperandMap(map, bits, 1, s.dtype, o.batch_entries, o.head_entries, o.rows,
                          (o.cols + 7) / 8, MaskBitsRowBytes(o.cols), box_cols / 8,
                          o.tiles.one_row ? 1 : box_rows, false);
}

// A bias `op` (or a dbias) at `base` in boxes of box_rows x 64 keys in the 128-byte
// swizzle (SwizzledTile's 64-column panels), or of one row of box_cols keys when the bias is
// broadcast over queries; *tiles: where a kernel finds a tile's boxes.
inline cudaError_t EncodeBiasMap(CUtensorMap* map, OperandTiles* tiles, const AttentionShape& s,
                                 const BroadcastOperand& op, const void* base, int box_rows,
                                 int box_cols) {
  const OperandShape o = OperandShapeOf(s, op);
  *tiles = o.tiles;
  return EncodeOperandMap(map, base, 2, s.dtype, o.batch_entries, o.head_entries, o.rows, o.cols,
                          o.cols * 2, o.tiles.one_row ? box_cols : 64,
                          o.tiles.one_row ? 1 : box_rows, !o.tiles.one_row);
}

// Distinct batch entries of k / v (1 when broadcast over every batch dim).
inline int64_t KvEntries(const AttentionShape& s) {
  const int64_t entry = s.seqlen_k * s.num_kv_heads * s.head_dim;
  int64_t last = 0;
  for (int d = 0; d < s.batch.rank; ++d) last += (s.batch.sizes[d] - 1) * s.kv_batch.strides[d];
  return last / entry + 1;
}

// (batch, head) pairs whose K and V fit in half of the L2 cache together (at least one).
inline int64_t HeadsSharingL2(const AttentionShape& s) {
  int dev = 0, l2 = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess) {
    l2 = 50 << 20;
  }
  const int64_t kv_bytes = 2 * s.seqlen_k * s.head_dim * 2 / s.heads_per_kv_head();
  const int64_t heads = kv_bytes > 0 ? (l2 / 2) / kv_bytes : 1;
  return heads < 1 ? 1 : heads;
}

// True when the Hopper forward takes this call (HopperForwardTakes: the head dim, no key
// splits, mask and bias layouts TMA reads) and TMA can address its operands; the
// FlashAttention-2-class forward runs the rest.
inline bool Takes(const FwdParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return HopperForwardTakes(p.s, p.num_splits) && aligned(p.q) && aligned(p.k) &&
         aligned(p.v) && aligned(p.out) && aligned(p.bias) && aligned(p.mask_map.bits);
}

template <typename Tr, typename T>
cudaError_t RunForward(const FwdParams& params, cudaStream_t stream) {
  const AttentionShape& s = params.s;
  FwdParamsSm90 P{};
  P.p = params;
  P.order.m_blocks = static_cast<int>((s.seqlen_q + Tr::BM - 1) / Tr::BM);
  P.order.heads = s.batch_count() * s.num_heads;
  P.order.tiles = P.order.heads * P.order.m_blocks;
  P.order.group_heads = HeadsSharingL2(s);
  P.order.counter = params.tile_counter;
  if (P.order.tiles == 0) return cudaSuccess;
  P.kv_entry_elems = s.seqlen_k * s.num_kv_heads * s.head_dim;
  P.band = detail::make_band(s);
  const int64_t kv_entries = KvEntries(s);
  const int64_t B = s.batch_count();
  cudaError_t e = EncodeRowMajorMap(&P.q_tma, params.q, s.dtype, B, s.seqlen_q, s.num_heads, Tr::D,
                                    Tr::BM);
  if (e == cudaSuccess) {
    e = EncodeRowMajorMap(&P.k_tma, params.k, s.dtype, kv_entries, s.seqlen_k, s.num_kv_heads,
                          Tr::D, Tr::BN);
  }
  if (e == cudaSuccess) {
    e = EncodeRowMajorMap(&P.v_tma, params.v, s.dtype, kv_entries, s.seqlen_k, s.num_kv_heads,
                          Tr::D, Tr::BN);
  }
  if (e == cudaSuccess && !params.out_f32) {
    e = EncodeRowMajorMap(&P.o_tma, params.out, s.dtype, B, s.seqlen_q, s.num_heads, Tr::D, 64);
  }
  if (e == cudaSuccess && params.bias != nullptr) {
    e = EncodeBiasMap(&P.bias_tma, &P.bias_tiles, s, s.bias, params.bias, Tr::BM, Tr::BN);
  }
  if (e == cudaSuccess && params.mask != nullptr) {
    e = EncodeMaskBitsMap(&P.mask_tma, &P.mask_tiles, s, params.mask_map.bits, Tr::BM, Tr::BN);
  }
  if (e != cudaSuccess) return e;
  auto kernel = fwd_kernel<Tr, T>;
  if (cudaError_t e2 = PrepareSmem(kernel, Tr::kSmem); e2 != cudaSuccess) return e2;
  if (P.order.counter != nullptr) {
    if (cudaError_t e3 = cudaMemsetAsync(P.order.counter, 0, sizeof(int), stream);
        e3 != cudaSuccess) {
      return e3;
    }
  }
  if constexpr (Tr::kThreshold) {  // Forward checked that the call has its drop map
    if (cudaError_t e4 = cudaMemsetAsync(params.drop_map, 0, s.drop_map_bytes(), stream);
        e4 != cudaSuccess) {
      return e4;
    }
  }
  const int64_t sms = MultiProcessors();
  const unsigned grid = static_cast<unsigned>(P.order.tiles < sms ? P.order.tiles : sms);
  kernel<<<grid, Tr::kThreads, Tr::kSmem, stream>>>(P);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda::sm90
