// Which backward task writes which dk/dv/dbias elements, so that every element is summed by one
// task in a fixed order: deterministic, no atomics, no read-modify-write races.
#pragma once

#include <cstdint>
#include <vector>

#include "common/params.h"

namespace dmattn::cpu {

// Distinct values (offsets) and, per item of a group, the index of its value.
struct Slots {
  std::vector<int64_t> offsets;
  std::vector<int> of_item;
};

// (batch, query head) items whose gradients land on shared elements: the same dk/dv rows (same
// dk batch offset and kv head: GQA groups, dk summed over a broadcast batch dim) or the same dbias
// entries (same dbias batch offset and head entry). A group is closed under both relations, so a
// task that owns one group and one key block owns every dk/dv/dbias element its items touch there.
// Ownership follows the gradients' layouts, which may differ from their inputs' (under vmap an
// unmapped k is read with stride 0 while its per-example dk is full-size).
struct OwnerGroup {
  std::vector<int64_t> items;  // flat b * num_heads + h, ascending
  Slots dkv;                   // AttentionShape::dkv_offset: where dk, dv sums go
  Slots kv;                    // AttentionShape::kv_offset: which k, v rows are read
  Slots dbias;                 // dbias.offset ({0} without a bias)
};

// The connected components of the items under "shares a dk/dv target or a dbias entry", ordered
// by their smallest item.
std::vector<OwnerGroup> PartitionIntoOwnerGroups(const AttentionShape& shape);

}  // namespace dmattn::cpu
