// Host entry points: build the kernel parameter blocks from the AttentionShape and dispatch to
// the compiled (head dim, dtype) instantiations. Never synchronises, never allocates: every
// decision here depends on shapes and pointers only, so the launches are CUDA-graph safe.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "cuda/attention.h"
#include "cuda/kernel_utils.cuh"
#include "cuda/launch.h"

namespace dmattn::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

bool Aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// 16-byte cp.async is possible for every tile of the operand: contiguous columns and every row
// start (batch, head and row offsets) a multiple of 16 bytes.
bool VectorOk(const AttentionShape& s, const BroadcastOperand& op, const void* ptr,
              int elem_bytes) {
  if (ptr == nullptr || !op.present || op.col_stride != 1) return false;
  const int64_t q = 16 / elem_bytes;
  if (op.row_stride % q != 0 || op.head_stride % q != 0) return false;
  for (int d = 0; d < s.batch.rank; ++d) {
    if (op.batch.strides[d] % q != 0) return false;
  }
  return Aligned(ptr, 16);
}

void FillCommon(const AttentionShape& s, float* bias_mul, float* softcap_in, float* softcap,
                float* softmax_mul) {
  *bias_mul = s.scale != 0.f ? 1.f / s.scale : 0.f;
  *softcap = s.softcap > 0.f ? s.softcap : 0.f;
  *softcap_in = s.softcap > 0.f ? s.scale / s.softcap : 0.f;
  *softmax_mul = s.softcap > 0.f ? kLog2e : s.scale * kLog2e;
}

struct Members {
  int member_dim[kMaxBatchDims] = {0, 0, 0, 0};
  int64_t members = 1;
  int64_t classes = 1;
};

Members KvMembers(const AttentionShape& s) {
  Members m;
  const BatchStrides& st = s.dkv_batch;
  for (int d = 0; d < s.batch.rank; ++d) {
    if (st.strides[d] == 0 && s.batch.sizes[d] > 1) {
      m.member_dim[d] = 1;
      m.members *= s.batch.sizes[d];
    } else {
      m.classes *= s.batch.sizes[d];
    }
  }
  return m;
}

// True when some dbias element receives contributions from more than one backward CTA, or from
// pairs that are not consecutive in a CTA's walk (batch member outer, group head inner), or
// when full query rows of one element come from more than one (batch, head) pair.
bool DbiasNeedsWorkspace(const AttentionShape& s) {
  if (!s.bias.present) return false;
  const BroadcastOperand& op = s.dbias;
  if (op.col_stride == 0) return true;  // sums over keys span key blocks (CTAs)
  const Members mem = KvMembers(s);
  const int64_t G = s.num_heads / s.num_kv_heads;
  const int64_t hpe = op.heads_per_entry;
  if (!(hpe == 1 || hpe == G)) return true;  // one entry shared by several kv heads
  bool member_bcast = false;
  bool seen_member_bcast = false;
  for (int d = 0; d < s.batch.rank; ++d) {
    if (s.batch.sizes[d] <= 1) continue;
    const bool bias_bcast = op.batch.strides[d] == 0;
    if (bias_bcast && !mem.member_dim[d]) return true;  // shared across classes (CTAs)
    if (mem.member_dim[d]) {
      if (bias_bcast) {
        member_bcast = true;
        seen_member_bcast = true;
      } else if (seen_member_bcast) {
        return true;  // a shared dim outside a distinct one: runs not contiguous
      }
    }
  }
  const bool shared_by_group = hpe == G && G > 1;
  if (op.row_stride != 0) return shared_by_group || member_bcast;  // full rows: no sharing
  if (hpe == 1 && G > 1 && member_bcast) return true;
  return false;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// fp32 bytes per split of the partial results: output rows and their lse.
int64_t SplitBytes(const AttentionShape& s) {
  return s.batch_count() * s.num_heads * s.seqlen_q * (s.head_dim + 1) *
         static_cast<int64_t>(sizeof(float));
}

// Query blocks of the forward (of every batch and head).
int64_t QueryBlocks(const AttentionShape& s) {
  return s.batch_count() * s.num_heads * CeilDiv(s.seqlen_q, ForwardTileOf(s).bm);
}

// Key blocks of the backward (of every kv head and dk/dv class) on its narrowest tile.
int64_t KeyBlocks(const AttentionShape& s) {
  return CeilDiv(s.seqlen_k, kSmallestBackwardKeyBlock) * s.num_kv_heads * KvMembers(s).classes;
}

// Bytes of a block order and its scratch (an int32 each per block), in whole 256-byte units so
// that the workspace after them stays aligned.
int64_t BlockOrderBytes(int64_t blocks) {
  return CeilDiv(2 * blocks * static_cast<int64_t>(sizeof(int32_t)), 256) * 256;
}

// Where a pass's workspace starts with a block order ([order][scratch], BlockOrderBytes): takes
// it from the front of `*workspace` (`*bytes` long) when `rest` bytes still fit after it, and
// advances past it; else leaves `order` null, so that the pass runs its blocks in plain order.
void TakeBlockOrder(int64_t blocks, int64_t rest, uint8_t** workspace, int64_t* bytes,
                    int32_t** order, int32_t** weight) {
  const int64_t order_bytes = BlockOrderBytes(blocks);
  if (*workspace == nullptr || *bytes < order_bytes + rest) return;
  *order = reinterpret_cast<int32_t*>(*workspace);
  *weight = *order + blocks;
  *workspace += order_bytes;
  *bytes -= order_bytes;
}

// The segment id rows of a call (ids of batch entries that share a row are read once) and the
// layout of their spans; rows 0 without segment ids.
SegmentSpanLayout SegmentSpans(const AttentionShape& s) {
  SegmentSpanLayout l;
  if (!s.has_segments) return l;
  l.rows = 1;
  for (int d = 0; d < s.batch.rank; ++d) {
    if (s.segments_batch.strides[d] != 0) l.rows *= s.batch.sizes[d];
  }
  l.q_cells = static_cast<int>(CeilDiv(s.seqlen_q, kSegmentCell));
  l.kv_cells = static_cast<int>(CeilDiv(s.seqlen_k, kSegmentCell));
  return l;
}

// In whole 256-byte units: the workspace after the spans stays aligned.
int64_t SegmentSpanBytes(const AttentionShape& s) {
  const SegmentSpanLayout l = SegmentSpans(s);
  return CeilDiv(l.rows * (l.q_cells + l.kv_cells) * static_cast<int64_t>(sizeof(int2)), 256) *
         256;
}

// With index masks or a gate threshold: takes their summaries ([segment spans][forms'
// summaries][gate bounds]) from the front of `*workspace` (`*bytes` long), points the params at
// the masks and the summaries, and runs their passes on `stream`. Without: none.
template <typename Args, typename Params>
cudaError_t TakeIndexMasks(const AttentionShape& s, const Args& args, uint8_t** workspace,
                           int64_t* bytes, Params* p, cudaStream_t stream) {
  p->q_segments = nullptr;
  p->kv_segments = nullptr;
  p->segment_spans = SegmentSpanLayout{};
  p->forms = MaskForms{};
  p->gate_bounds = GateBounds{};
  const int64_t need = IndexMaskBytes(s);
  if (need == 0) return cudaSuccess;
  if (*bytes < need) return cudaErrorInvalidValue;
  uint8_t* spans_at = *workspace;
  uint8_t* forms_at = spans_at + SegmentSpanBytes(s);
  uint8_t* bounds_at = forms_at + MaskFormsBytes(s);
  *workspace += need;
  *bytes -= need;
  if (s.has_segments) {
    if (args.q_segments == nullptr || args.kv_segments == nullptr) return cudaErrorInvalidValue;
    p->q_segments = args.q_segments;
    p->kv_segments = args.kv_segments;
    p->segment_spans = SegmentSpans(s);
    auto* spans = reinterpret_cast<int2*>(spans_at);
    p->segment_spans.spans = spans;
    if (cudaError_t e = BuildSegmentSpans(args.q_segments, args.kv_segments, s.seqlen_q,
                                          s.seqlen_k, p->segment_spans, spans, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  if (cudaError_t e = BuildMaskForms(s, args.key_start, args.key_end, args.row_start,
                                     args.row_end, args.block_indices, forms_at, &p->forms,
                                     stream);
      e != cudaSuccess) {
    return e;
  }
  return BuildGateBounds(s, args.alpha, args.delta, bounds_at, &p->gate_bounds, stream);
}

int64_t DbiasWorkspaceBytes(const AttentionShape& s) {
  return DbiasNeedsWorkspace(s) ? s.dbias.num_elements * static_cast<int64_t>(sizeof(float)) : 0;
}

template <int D>
cudaError_t ForwardD(const AttentionShape& shape, const FwdParams& p, cudaStream_t stream) {
  if (shape.dtype == ElementType::kBFloat16) {
#if defined(DMATTN_ENABLE_BF16)
    return RunForward<D, __nv_bfloat16>(p, stream);
#endif
  } else if (shape.dtype == ElementType::kFloat16) {
#if defined(DMATTN_ENABLE_FP16)
    return RunForward<D, __half>(p, stream);
#endif
  }
  return cudaErrorNotSupported;
}

template <int D>
cudaError_t BackwardD(const AttentionShape& shape, const BwdLaunch& l, cudaStream_t stream) {
  if (shape.dtype == ElementType::kBFloat16) {
#if defined(DMATTN_ENABLE_BF16)
    return RunBackward<D, __nv_bfloat16>(l, stream);
#endif
  } else if (shape.dtype == ElementType::kFloat16) {
#if defined(DMATTN_ENABLE_FP16)
    return RunBackward<D, __half>(l, stream);
#endif
  }
  return cudaErrorNotSupported;
}

std::atomic<int> forward_kernel_setting{static_cast<int>(ForwardKernel::kAuto)};
std::atomic<int> backward_kernel_setting{static_cast<int>(BackwardKernel::kAuto)};

// The Hopper forward reads bias tiles by TMA (rows of whole 16-byte units) and mask tiles from
// the mask's bits (rows padded to 16 bytes: any Lk), neither broadcast over keys, at the head
// dims with 128-key blocks (sm90/fwd_launch.cuh).
bool HopperReadsOperand(const AttentionShape& s, const BroadcastOperand& op, int64_t keys_per_unit) {
  return !op.present ||
         (s.head_dim <= 128 && op.col_stride == 1 && s.seqlen_k % keys_per_unit == 0);
}

// The call's window table as the kernels read it (kernel_params.h): each kv head's band, the
// call's own band narrowed by the head's (sink, left, right) row, and its sink (at most Lk).
HeadWindows KernelHeadWindows(const AttentionShape& s) {
  HeadWindows w;
  if (s.head_windows == nullptr) return w;
  w.heads = static_cast<int>(s.num_kv_heads);
  const detail::Band outer = detail::make_band(s);
  for (int g = 0; g < w.heads; ++g) {
    const int64_t* row = s.head_windows + 3 * g;
    AttentionShape head = s;
    head.window_left = row[1];
    head.window_right = row[2];
    const detail::Band own = detail::make_band(head);
    w.head[g].dmin = std::max(outer.dmin, own.dmin);
    w.head[g].dmax = std::min(outer.dmax, own.dmax);
    w.head[g].sink = static_cast<int>(std::min(row[0], s.seqlen_k));
  }
  return w;
}

// Block indices on the Hopper forward: alone, their blocks whole multiples of 64 x 64 (each
// consumer warpgroup's 64 rows lie in one query block, each 64- or 128-key block in one key
// block: BlockIndicesHoldTiles), at D <= 128, with no mask, bias, segment ids, window table, gate
// or threshold beside them. The others run the FlashAttention-2-class tiles.
bool HopperTakesForms(const AttentionShape& s) {
  return BlockIndicesHoldTiles(s, 64, 64) && s.head_dim <= 128 && !s.mask.present &&
         !s.bias.present &&
         !s.has_segments && s.head_windows == nullptr && !s.has_gate &&
         s.softmax_threshold == 0.0;
}

}  // namespace

void SetForwardKernel(ForwardKernel kernel) {
  forward_kernel_setting.store(static_cast<int>(kernel), std::memory_order_relaxed);
}
ForwardKernel ForwardKernelSetting() {
  return static_cast<ForwardKernel>(forward_kernel_setting.load(std::memory_order_relaxed));
}
void SetBackwardKernel(BackwardKernel kernel) {
  backward_kernel_setting.store(static_cast<int>(kernel), std::memory_order_relaxed);
}
BackwardKernel BackwardKernelSetting() {
  return static_cast<BackwardKernel>(backward_kernel_setting.load(std::memory_order_relaxed));
}

bool HopperForwardTakes(const AttentionShape& s, int64_t num_splits) {
  return ForwardKernelSetting() != ForwardKernel::kFlash2 && HopperKernels() &&
         HasHopperForward(s.head_dim) && HopperReadsOperand(s, s.mask, 1) &&
         HopperReadsOperand(s, s.bias, 8) && num_splits == 1 && s.seqlen_q > 0 &&
         s.seqlen_k > 0 && (!s.has_segments || s.head_dim <= 128) &&
         !(s.has_segments && s.head_windows != nullptr) &&
         (!s.has_mask_forms() || HopperTakesForms(s)) &&
         (!s.has_gate || (s.head_dim <= 128 && !s.mask.present && !s.bias.present &&
                          !s.has_segments && s.head_windows == nullptr && s.softcap == 0.f)) &&
         (s.softmax_threshold == 0.0 || (ThresholdTakes(s) && !s.has_gate && !s.has_segments &&
                                         s.head_windows == nullptr));
}

bool ThresholdTakes(const AttentionShape& s) {
  return (s.head_dim == 64 || s.head_dim == 128) && !s.has_gate_threshold();
}

bool DecodeTakes(const AttentionShape& s) {
  return ForwardKernelSetting() != ForwardKernel::kFlash2 && HasDecodeForward(s.head_dim) &&
         s.seqlen_q >= 1 && s.seqlen_q <= kDecodeMaxQueryRows && s.seqlen_k > 0 &&
         !s.has_segments && !s.has_mask_forms() && !s.has_gate && s.softmax_threshold == 0.0;
}

const char* ForwardKernelName(const AttentionShape& shape) {
  if (shape.softmax_threshold > 0.0 && !ThresholdTakes(shape)) return "none";
  if (DecodeTakes(shape)) return "decode";
  const int64_t splits = ForwardSplits(shape);
  if (HopperForwardTakes(shape, splits)) return "hopper";
  return splits > 1 ? "flash2_split" : "flash2";
}

int MultiProcessors() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    return 132;
  }
  return n;
}

bool HopperKernels() {
#if defined(DMATTN_SM90A)
  int dev = 0, major = 0;
  return cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         major == 9;
#else
  return false;
#endif
}

namespace {

// Key splits of the decode forward: the count that finishes first when each CTA costs its
// share of the key tiles plus two (the ring's fill), in waves of the CTAs that run at once.
int64_t DecodeSplits(const AttentionShape& s) {
  const int64_t rows = s.heads_per_kv_head() * s.seqlen_q;
  const int64_t ctas = s.batch_count() * s.num_kv_heads * CeilDiv(rows, DecodeRowTile(rows));
  const int64_t tiles = CeilDiv(s.seqlen_k, kMaskMapCell);
  const int64_t slots = MultiProcessors() * static_cast<int64_t>(DecodeCtasPerSm(s.head_dim));
  constexpr int64_t kMaxSplits = 64, kFillTiles = 2;
  int64_t best = 1, best_cost = -1;
  for (int64_t n = 1; n <= std::min(kMaxSplits, tiles); ++n) {
    const int64_t cost = CeilDiv(ctas * n, slots) * (CeilDiv(tiles, n) + kFillTiles);
    if (best_cost < 0 || cost < best_cost) {
      best = n;
      best_cost = cost;
    }
  }
  return best;
}

// What every entry point refuses. The kernels carry the bias and the gate in units of 1 / scale
// and hide scores as -inf before multiplying them by the scale, so a scale <= 0 would drop the
// bias and gate (0) or turn hidden scores into +inf (< 0): such calls take the reference.
cudaError_t CheckShape(const AttentionShape& s) {
  if (s.dtype != ElementType::kBFloat16 && s.dtype != ElementType::kFloat16) {
    return cudaErrorNotSupported;
  }
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (!(s.scale > 0.f) || !std::isfinite(s.scale)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

// Key splits of the forward: none while the (query block, head, batch) grid fills 80 % of the
// SMs' CTA slots (two per SM); otherwise the smallest count whose waves are filled within 85 % of
// the best count's, among counts that shorten the longest split.
int64_t ForwardSplits(const AttentionShape& s) {
  if (DecodeTakes(s)) return DecodeSplits(s);
  if (s.softmax_threshold > 0.0) return 1;  // the rule walks each row's keys in one pass
  const int64_t ctas = QueryBlocks(s);
  const int64_t key_blocks = CeilDiv(s.seqlen_k, ForwardTileOf(s).bn);
  const int64_t slots = ForwardSlots();
  if (ctas == 0 || 5 * ctas >= 4 * slots || key_blocks < 2) return 1;
  auto filled = [&](int64_t n) {
    const int64_t busy = ctas * n;
    return static_cast<double>(busy) / static_cast<double>(CeilDiv(busy, slots) * slots);
  };
  auto shortens = [&](int64_t n) {
    return n == 1 || CeilDiv(key_blocks, n) < CeilDiv(key_blocks, n - 1);
  };
  constexpr int64_t kMaxSplits = 64;
  const int64_t most = key_blocks < kMaxSplits ? key_blocks : kMaxSplits;
  double best = 0.0;
  for (int64_t n = 1; n <= most; ++n) {
    if (shortens(n) && filled(n) > best) best = filled(n);
  }
  for (int64_t n = 1; n <= most; ++n) {
    if (shortens(n) && filled(n) >= 0.85 * best) return n;
  }
  return 1;
}

bool SupportsHeadWindows(const AttentionShape& s) {
  return s.head_windows == nullptr || s.num_kv_heads <= kMaxWindowHeads;
}

int64_t IndexMaskBytes(const AttentionShape& s) {
  return SegmentSpanBytes(s) + MaskFormsBytes(s) + GateBoundsBytes(s);
}

// The forward's workspace: [index masks' summaries][tile counter][query-block order][split
// partials].
constexpr int64_t kTileCounterBytes = 256;

int64_t ForwardWorkspaceBytes(const AttentionShape& shape) {
  const int64_t splits = ForwardSplits(shape);
  return IndexMaskBytes(shape) + kTileCounterBytes + BlockOrderBytes(QueryBlocks(shape)) +
         (splits > 1 ? splits * SplitBytes(shape) : 0);
}

bool SupportsHeadDim(int64_t head_dim) {
  switch (head_dim) {
#if defined(DMATTN_ENABLE_HDIM32)
    case 32:
#endif
#if defined(DMATTN_ENABLE_HDIM64)
    case 64:
#endif
#if defined(DMATTN_ENABLE_HDIM96)
    case 96:
#endif
#if defined(DMATTN_ENABLE_HDIM128)
    case 128:
#endif
#if defined(DMATTN_ENABLE_HDIM192)
    case 192:
#endif
#if defined(DMATTN_ENABLE_HDIM256)
    case 256:
#endif
      return true;
    default:
      return false;
  }
}

int64_t BackwardWorkspaceBytes(const AttentionShape& shape) {
  return IndexMaskBytes(shape) + BlockOrderBytes(KeyBlocks(shape)) + DbiasWorkspaceBytes(shape) +
         DqTurnBytes(shape);
}

cudaError_t Forward(const AttentionShape& shape, const ForwardArgs& args, cudaStream_t stream) {
  if (cudaError_t e = CheckShape(shape); e != cudaSuccess) return e;
  // Only the decode forward reads a paged cache: the front end gathers the pages of other calls.
  if (shape.pages.present() && !DecodeTakes(shape)) return cudaErrorNotSupported;
  FwdParams p{};
  p.s = shape;
  p.q = args.q;
  p.k = args.k;
  p.v = args.v;
  p.mask = shape.mask.present ? reinterpret_cast<const uint8_t*>(args.mask) : nullptr;
  p.bias = shape.bias.present ? args.bias : nullptr;
  p.q_lens = shape.has_seqlens ? args.q_lens : nullptr;
  p.kv_lens = shape.has_seqlens ? args.kv_lens : nullptr;
  p.page_table = shape.pages.present() ? args.page_table : nullptr;
  p.alpha = shape.has_gate ? args.alpha : nullptr;
  p.delta = shape.has_gate ? args.delta : nullptr;
  if (shape.has_gate && (p.alpha == nullptr || p.delta == nullptr)) return cudaErrorInvalidValue;
  p.drop_map = shape.softmax_threshold > 0.0 ? args.drop_map : nullptr;
  if (shape.softmax_threshold > 0.0 && p.drop_map == nullptr) return cudaErrorInvalidValue;
  p.out = args.out;
  p.out_f32 = args.out_f32;
  p.lse = args.lse;
  if (!SupportsHeadWindows(shape)) return cudaErrorNotSupported;
  p.windows = KernelHeadWindows(shape);  // the kernels' copy of the host table
  FillCommon(shape, &p.bias_mul, &p.softcap_in, &p.softcap, &p.softmax_mul);
  p.lse_mul = shape.softcap > 0.f ? 1.f : shape.scale;
  p.mask_vec = VectorOk(shape, shape.mask, p.mask, 1);
  p.bias_vec = VectorOk(shape, shape.bias, p.bias, 2);
  if (!p.mask) p.s.mask.present = false;
  if (!p.bias) p.s.bias.present = false;
  if (p.mask != nullptr && (args.mask_map == nullptr || args.mask_bits == nullptr)) {
    return cudaErrorInvalidValue;
  }
  p.mask_map = MaskBlockMapLayout(p.s, args.mask_map, args.mask_bits);
  // The workspace ([index masks' summaries][tile counter][block order][split partials]) was
  // sized at trace time by the same rules; no counter, no order and fewer splits if it came out
  // smaller.
  auto* workspace = static_cast<uint8_t*>(args.workspace[0]);
  int64_t workspace_bytes = workspace != nullptr ? args.workspace_bytes[0] : 0;
  if (cudaError_t e = TakeIndexMasks(shape, args, &workspace, &workspace_bytes, &p, stream);
      e != cudaSuccess) {
    return e;
  }
  if (workspace_bytes >= kTileCounterBytes) {
    p.tile_counter = reinterpret_cast<int*>(workspace);
    workspace += kTileCounterBytes;
    workspace_bytes -= kTileCounterBytes;
  }
  if (DecodeTakes(shape)) {
    // The decode forward has no block order: its split counters, one per (batch, kv head, row
    // block), at most B * H of them, take that space.
    int32_t* unused = nullptr;
    TakeBlockOrder(QueryBlocks(shape), 0, &workspace, &workspace_bytes, &p.split_counters,
                   &unused);
  } else {
    TakeBlockOrder(QueryBlocks(shape), 0, &workspace, &workspace_bytes, &p.block_order,
                   &p.block_weight);
  }
  const int64_t split_bytes = SplitBytes(shape);
  int64_t splits = ForwardSplits(shape);
  if (split_bytes > 0 && splits * split_bytes > workspace_bytes) {
    splits = workspace_bytes / split_bytes;
  }
  p.num_splits = splits > 1 ? static_cast<int>(splits) : 1;
  if (p.num_splits > 1) {
    p.o_partial = reinterpret_cast<float*>(workspace);
    p.lse_partial = p.o_partial + p.num_splits * shape.batch_count() * shape.num_heads *
                                      shape.seqlen_q * shape.head_dim;
  }

  switch (shape.head_dim) {
#if defined(DMATTN_ENABLE_HDIM32)
    case 32: return ForwardD<32>(shape, p, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM64)
    case 64: return ForwardD<64>(shape, p, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM96)
    case 96: return ForwardD<96>(shape, p, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM128)
    case 128: return ForwardD<128>(shape, p, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM192)
    case 192: return ForwardD<192>(shape, p, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM256)
    case 256: return ForwardD<256>(shape, p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}

cudaError_t Backward(const AttentionShape& shape, const BackwardArgs& args, cudaStream_t stream) {
  if (cudaError_t e = CheckShape(shape); e != cudaSuccess) return e;
  if (args.softmax_d == nullptr) return cudaErrorInvalidValue;
  BwdLaunch l;
  BwdParams& p = l.p;
  p = BwdParams{};
  p.s = shape;
  p.q = args.q;
  p.k = args.k;
  p.v = args.v;
  p.dout = args.dout;
  p.lse = args.lse;
  if (shape.has_gate) {  // the kernels add the gate's gradients into zeros
    if (args.alpha == nullptr || args.delta == nullptr || args.dalpha == nullptr ||
        args.ddelta == nullptr) {
      return cudaErrorInvalidValue;
    }
    p.alpha = args.alpha;
    p.delta = args.delta;
    p.dalpha = args.dalpha;
    p.ddelta = args.ddelta;
    const int64_t b = shape.batch_count();
    if (cudaError_t e = cudaMemsetAsync(p.dalpha, 0, b * shape.seqlen_q * shape.num_heads * 4,
                                        stream);
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e = cudaMemsetAsync(p.ddelta, 0,
                                        b * shape.seqlen_k * shape.num_kv_heads * 4, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  p.softmax_d = args.softmax_d;
  p.drop_map = shape.softmax_threshold > 0.0 ? args.drop_map : nullptr;
  if (shape.softmax_threshold > 0.0 && p.drop_map == nullptr) return cudaErrorInvalidValue;
  p.mask = shape.mask.present ? reinterpret_cast<const uint8_t*>(args.mask) : nullptr;
  p.bias = shape.bias.present ? args.bias : nullptr;
  p.q_lens = shape.has_seqlens ? args.q_lens : nullptr;
  p.kv_lens = shape.has_seqlens ? args.kv_lens : nullptr;
  p.dq_accum = static_cast<float*>(args.workspace[0]);
  p.dk = args.dk;
  p.dv = args.dv;
  p.dbias = args.dbias;
  p.dbias_accum = nullptr;
  if (!SupportsHeadWindows(shape)) return cudaErrorNotSupported;
  p.windows = KernelHeadWindows(shape);
  for (int g = 0; g < p.windows.heads; ++g) p.ranks_outer |= p.windows.head[g].sink > 0;
  FillCommon(shape, &p.bias_mul, &p.softcap_in, &p.softcap, &p.softmax_mul);
  p.scale = shape.scale;
  p.mask_vec = VectorOk(shape, shape.mask, p.mask, 1);
  p.bias_vec = VectorOk(shape, shape.bias, p.bias, 2);
  if (!p.mask) p.s.mask.present = false;
  if (!p.bias) p.s.bias.present = false;
  p.compute_dq = !shape.deterministic;
  if (p.compute_dq && p.dq_accum == nullptr) return cudaErrorInvalidValue;
  if (p.mask != nullptr && (args.mask_map == nullptr || args.mask_bits == nullptr)) {
    return cudaErrorInvalidValue;
  }
  p.mask_map = MaskBlockMapLayout(p.s, args.mask_map, args.mask_bits);

  const Members mem = KvMembers(shape);
  p.dkv_batch = shape.dkv_batch;
  for (int d = 0; d < kMaxBatchDims; ++d) p.member_dim[d] = mem.member_dim[d];
  p.kv_members = mem.members;
  p.kv_classes = mem.classes;

  // Workspace 1 ([index masks' summaries][key-block order][dbias accumulator][dQ turn flags])
  // was sized at trace time by the same rules; no order if it came out smaller.
  auto* workspace = static_cast<uint8_t*>(args.workspace[1]);
  int64_t workspace_bytes = workspace != nullptr ? args.workspace_bytes[1] : 0;
  if (cudaError_t e = TakeIndexMasks(shape, args, &workspace, &workspace_bytes, &p, stream);
      e != cudaSuccess) {
    return e;
  }
  const bool has_dbias = p.bias != nullptr && args.dbias != nullptr;
  const int64_t dbias_bytes = has_dbias ? DbiasWorkspaceBytes(shape) : 0;
  const int64_t turn_bytes = DqTurnBytes(shape);
  TakeBlockOrder(KeyBlocks(shape), dbias_bytes + turn_bytes, &workspace, &workspace_bytes,
                 &p.block_order, &p.block_weight);
  p.dq_turns = nullptr;
  if (turn_bytes > 0 && workspace != nullptr && workspace_bytes >= dbias_bytes + turn_bytes) {
    p.dq_turns = reinterpret_cast<int32_t*>(workspace + dbias_bytes);
  }

  p.dbias_mode = kDbiasNone;
  if (has_dbias) {
    p.dbias_op = shape.dbias;
    l.dbias_elems = p.dbias_op.num_elements;
    if (dbias_bytes > 0) {
      p.dbias_mode = kDbiasAtomic;
      p.dbias_accum = reinterpret_cast<float*>(workspace);
      if (workspace == nullptr || workspace_bytes < dbias_bytes) return cudaErrorInvalidValue;
    } else {
      p.dbias_mode = kDbiasDirect;
      const bool full_rows = p.dbias_op.row_stride != 0 && !shape.has_seqlens;
      // The fill pass knows the tiles that the band and the mask skip, not those the index
      // masks, the gate threshold or the softmax threshold drop.
      p.dbias_fill = full_rows && !shape.has_segments && !shape.has_mask_forms() &&
                     !shape.has_gate_threshold() && shape.softmax_threshold == 0.0;
      p.dbias_staged = full_rows && p.dbias_op.row_stride % 8 == 0 &&
                       shape.seqlen_k % 8 == 0 && Aligned(p.dbias, 16);
    }
  }

  l.out = args.out;
  l.out_f32 = args.out_f32;
  l.dlse = args.dlse;
  l.softmax_d = args.softmax_d;
  l.dq = args.dq;

  switch (shape.head_dim) {
#if defined(DMATTN_ENABLE_HDIM32)
    case 32: return BackwardD<32>(shape, l, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM64)
    case 64: return BackwardD<64>(shape, l, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM96)
    case 96: return BackwardD<96>(shape, l, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM128)
    case 128: return BackwardD<128>(shape, l, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM192)
    case 192: return BackwardD<192>(shape, l, stream);
#endif
#if defined(DMATTN_ENABLE_HDIM256)
    case 256: return BackwardD<256>(shape, l, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}

}  // namespace dmattn::cuda
