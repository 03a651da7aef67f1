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

}  // namespace

cudaError_t EncodeRowMajorMap(CUtensorMap* map, const void* base, ElementType dtype,
                              int64_t entries, int64_t rows, int64_t heads, int64_t head_dim,
                              int box_rows) {
  constexpr int64_t kMaxDim = int64_t{1} << 31;  // coordinates are int32
  constexpr int64_t kMaxStride = int64_t{1} << 40;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeTiled();
  const int64_t row_bytes = heads * head_dim * 2;
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || head_dim % 64 != 0 ||
      entries >= kMaxDim || rows >= kMaxDim || heads >= kMaxDim ||
      rows * row_bytes >= kMaxStride) {
    return cudaErrorNotSupported;
  }
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(entries)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim * 2),
                                 static_cast<cuuint64_t>(row_bytes),
                                 static_cast<cuuint64_t>(rows * row_bytes)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = dtype == ElementType::kBFloat16
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(map, type, 4, const_cast<void*>(base), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
}

}  // namespace dmattn::cuda::sm90
