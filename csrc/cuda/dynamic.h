// Dynamic-mask attention helpers on the GPU: the top-window mask of per-key scores and the
// gradient of the per-block key gathers (jax_dmattn/dynamic.py). Host code only here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace dmattn::cuda {

// leave[r, j] = index of the `window`-th key of row r that beats key j, or lk when fewer do
// (keys before j beat it with a key >= its own, keys after j with a key >) : key j is among the
// `window` best of keys 0..t exactly for j <= t < leave[r, j]. key and leave are [rows, lk] int32
// order keys (larger = better). One warp per key scans the row in index order, 1024 keys a step,
// and stops at the window-th beater: O(lk * window * log(lk / window)) comparisons for random
// scores, at most lk^2. Launches on `stream`; never synchronises.
cudaError_t TopkLeave(const int32_t* key, int32_t* leave, int64_t rows, int64_t lk, int64_t window,
                      cudaStream_t stream);

// mask[g, n, r, u] = first[g, n, u] <= n * block + r < end[g, n, u]: the per-block masks of
// dynamic attention's compact key lists, bool [G, nb, block, U] from int32 [G, nb, U] row
// ranges (16 slots x 16 rows per thread); `groups` = G * nb, the rows of `first`. Launches on
// `stream`; never synchronises.
cudaError_t RangeMask(const int32_t* first, const int32_t* end, bool* mask, int64_t groups,
                      int64_t num_blocks, int64_t block, int64_t slots, cudaStream_t stream);

// out <- the listed-keys gradient sum (common/params.h): one warp per (batch, key, channel),
// deterministic (a fixed order of float32 additions). Launches on `stream`; never synchronises.
cudaError_t SumListedKeys(const ListedKeysShape& shape, const ListedKeysArgs& args,
                          cudaStream_t stream);

}  // namespace dmattn::cuda
