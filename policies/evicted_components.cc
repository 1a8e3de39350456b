#include "policies/evicted_components.h"

#include <algorithm>
#include <utility>

namespace deltad::policy {

void EvictedComponents::Grow(uint32_t slot) {
  if (slot < parent_.size()) return;
  const size_t n = std::max<size_t>(slot + 1, parent_.size() * 2);
  parent_.resize(n, kNone);
  own_cost_.resize(n, 0);
  cost_.resize(n, 0);
  members_.resize(n);
}

void EvictedComponents::Insert(uint32_t slot, int64_t cost_ns) {
  Grow(slot);
  if (parent_[slot] != kNone) return;
  parent_[slot] = slot;
  own_cost_[slot] = cost_ns;
  cost_[slot] = cost_ns;
  members_[slot].assign(1, slot);
  ++count_;
}

uint32_t EvictedComponents::Find(uint32_t slot) const {
  while (parent_[slot] != slot) {
    parent_[slot] = parent_[parent_[slot]];  // path halving
    slot = parent_[slot];
  }
  return slot;
}

void EvictedComponents::Union(uint32_t a, uint32_t b) {
  uint32_t ra = Find(a);
  uint32_t rb = Find(b);
  if (ra == rb) return;
  // Merge the smaller member list into the larger: O(n log n) in total.
  if (members_[ra].size() < members_[rb].size()) std::swap(ra, rb);
  parent_[rb] = ra;
  cost_[ra] += cost_[rb];
  members_[ra].insert(members_[ra].end(), members_[rb].begin(),
                      members_[rb].end());
  members_[rb].clear();
  members_[rb].shrink_to_fit();
}

void EvictedComponents::Erase(uint32_t slot, NeighbourFn neighbours) {
  if (!Contains(slot)) return;
  const uint32_t root = Find(slot);
  std::vector<uint32_t> rest = std::move(members_[root]);
  members_[root].clear();
  for (uint32_t m : rest) parent_[m] = kNone;
  count_ -= rest.size();
  for (uint32_t m : rest) {
    if (m != slot) Insert(m, own_cost_[m]);
  }
  for (uint32_t m : rest) {
    if (m == slot) continue;
    neighbours(m, [&](uint32_t n) {
      if (n != slot && Contains(n)) Union(m, n);
    });
  }
}

}  // namespace deltad::policy
