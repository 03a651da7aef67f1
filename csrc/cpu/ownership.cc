#include "cpu/ownership.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>

namespace dmattn::cpu {
namespace {

// Union-find over item indices.
class DisjointSets {
 public:
  explicit DisjointSets(int64_t n) : parent_(n) { std::iota(parent_.begin(), parent_.end(), 0); }
  int64_t Find(int64_t x) {
    while (parent_[x] != x) x = parent_[x] = parent_[parent_[x]];
    return x;
  }
  void Union(int64_t a, int64_t b) {
    a = Find(a);
    b = Find(b);
    if (a != b) parent_[std::max(a, b)] = std::min(a, b);  // the root stays the smallest item
  }

 private:
  std::vector<int64_t> parent_;
};

// Records an item's value, reusing the slot of an equal value (groups are small; a linear scan is
// enough).
void AddToSlots(Slots& slots, int64_t offset) {
  const auto found = std::find(slots.offsets.begin(), slots.offsets.end(), offset);
  slots.of_item.push_back(static_cast<int>(found - slots.offsets.begin()));
  if (found == slots.offsets.end()) slots.offsets.push_back(offset);
}

}  // namespace

std::vector<OwnerGroup> PartitionIntoOwnerGroups(const AttentionShape& shape) {
  const int64_t heads = shape.num_heads, count = shape.batch_count() * heads;
  auto kv_head = [&](int64_t item) { return (item % heads) / shape.heads_per_kv_head(); };
  auto dkv_key = [&](int64_t item) { return shape.dkv_offset(item / heads, kv_head(item)); };
  auto kv_key = [&](int64_t item) { return shape.kv_offset(item / heads, kv_head(item)); };
  auto dbias_key = [&](int64_t item) {
    return shape.dbias.present ? shape.dbias.offset(shape.batch, item / heads, item % heads) : 0;
  };

  DisjointSets sets(count);
  std::unordered_map<int64_t, int64_t> first_with_dkv, first_with_dbias;
  for (int64_t item = 0; item < count; ++item) {
    sets.Union(item, first_with_dkv.emplace(dkv_key(item), item).first->second);
    sets.Union(item, first_with_dbias.emplace(dbias_key(item), item).first->second);
  }

  std::vector<OwnerGroup> groups;
  std::unordered_map<int64_t, size_t> group_of_root;
  for (int64_t item = 0; item < count; ++item) {
    const auto found = group_of_root.emplace(sets.Find(item), groups.size());
    if (found.second) groups.emplace_back();
    OwnerGroup& g = groups[found.first->second];
    g.items.push_back(item);
    AddToSlots(g.dkv, dkv_key(item));
    AddToSlots(g.kv, kv_key(item));
    AddToSlots(g.dbias, dbias_key(item));
  }
  return groups;
}

}  // namespace dmattn::cpu
