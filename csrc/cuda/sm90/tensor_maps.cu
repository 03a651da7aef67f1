#include "cuda/sm90/tensor_maps.h"

#include <cudaTypedefs.h>

namespace dmattn::cuda::sm90 {
namespace {

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A 4-d map, dims innermost first, strides in bytes of dims 1..3.
cudaError_t Encode(CUtensorMap* map, const void* base, CUtensorMapDataType type,
                   const int64_t (&dims)[4], const int64_t (&strides)[3], const int (&box)[4],
                   CUtensorMapSwizzle swizzle) {
  constexpr int64_t kMaxDim = int64_t{1} << 31;  // coordinates are int32
  constexpr int64_t kMaxStride = int64_t{1} << 40;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeTiled();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    return cudaErrorNotSupported;
  }
  cuuint64_t global_dims[4], global_strides[3];
  cuuint32_t box_dims[4], element_strides[4];
  for (int i = 0; i < 4; ++i) {
    if (dims[i] < 1 || dims[i] >= kMaxDim) return cudaErrorNotSupported;
    global_dims[i] = static_cast<cuuint64_t>(dims[i]);
    box_dims[i] = static_cast<cuuint32_t>(box[i]);
    element_strides[i] = 1;
  }
  for (int i = 0; i < 3; ++i) {
    if (strides[i] % 16 != 0 || strides[i] >= kMaxStride) return cudaErrorNotSupported;
    global_strides[i] = static_cast<cuuint64_t>(strides[i]);
  }
  const CUresult r = encode(map, type, 4, const_cast<void*>(base), global_dims, global_strides,
                            box_dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
}

CUtensorMapDataType Type16(ElementType dtype) {
  return dtype == ElementType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

}  // namespace

cudaError_t EncodeRowMajorMap(CUtensorMap* map, const void* base, ElementType dtype,
                              int64_t entries, int64_t rows, int64_t heads, int64_t head_dim,
                              int box_rows) {
  const int64_t row_bytes = heads * head_dim * 2;
  return Encode(map, base, Type16(dtype), {head_dim, heads, rows, entries},
                {head_dim * 2, row_bytes, rows * row_bytes}, {64, 1, box_rows, 1},
                CU_TENSOR_MAP_SWIZZLE_128B);
}

cudaError_t EncodeOperandMap(CUtensorMap* map, const void* base, int element_bytes,
                             ElementType dtype, int64_t batch_entries, int64_t head_entries,
                             int64_t rows, int64_t cols, int64_t row_bytes, int box_cols,
                             int box_rows, bool swizzle) {
  return Encode(map, base, element_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : Type16(dtype),
                {cols, rows, head_entries, batch_entries},
                {row_bytes, rows * row_bytes, head_entries * rows * row_bytes},
                {box_cols, box_rows, 1, 1},
                swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE);
}

cudaError_t EncodeVectorMap(CUtensorMap* map, const float* base, int64_t elems, int box) {
  const int64_t bytes = (elems * 4 + 15) / 16 * 16;  // the unit dims' strides (never stepped)
  return Encode(map, base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, {elems, 1, 1, 1},
                {bytes, bytes, bytes}, {box, 1, 1, 1}, CU_TENSOR_MAP_SWIZZLE_NONE);
}

}  // namespace dmattn::cuda::sm90
