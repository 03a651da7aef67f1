// CPU attention kernels: flash-style tiles with online softmax, threads over independent tiles.
#pragma once

#include <cstdint>
#include <functional>

#include "common/params.h"

namespace dmattn::cpu {

// Runs task(0) ... task(count - 1), possibly concurrently; returns when all have finished.
using ParallelFor = std::function<void(int64_t count, const std::function<void(int64_t)>& task)>;

// out, lse <- attention(q, k, v, mask, bias). Deterministic whatever the number of threads.
void Forward(const AttentionShape& shape, const ForwardArgs& args, const ParallelFor& parallel_for);

// dq, dk, dv, dbias <- gradients, each reduced over the dims its operand broadcasts over.
void Backward(const AttentionShape& shape, const BackwardArgs& args,
              const ParallelFor& parallel_for);

// out <- the listed-keys gradient sum (common/params.h). Deterministic.
void SumListedKeys(const ListedKeysShape& shape, const ListedKeysArgs& args,
                   const ParallelFor& parallel_for);

}  // namespace dmattn::cpu
