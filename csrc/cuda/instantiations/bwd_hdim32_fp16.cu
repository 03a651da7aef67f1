// One compiled (direction, head dim, dtype) set; the file name is what CMake selects on.
#include "cuda/launch_template.cuh"

namespace dmattn::cuda {
DMATTN_INSTANTIATE_BWD(32, __half)
}  // namespace dmattn::cuda
