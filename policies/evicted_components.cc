#include "policies/evicted_components.h"

#include <algorithm>
#include <utility>

namespace deltad::policy {

void EvictedComponents::Grow(uint32_t slot) {
  if (slot < component_.size()) return;
  const size_t n = std::max<size_t>(slot + 1, component_.size() * 2);
  component_.resize(n, kNone);
  position_.resize(n, 0);
  own_cost_.resize(n, 0);
}

uint32_t EvictedComponents::NewGroup() {
  if (!free_groups_.empty()) {
    const uint32_t g = free_groups_.back();
    free_groups_.pop_back();
    return g;
  }
  groups_.emplace_back();
  return static_cast<uint32_t>(groups_.size() - 1);
}

void EvictedComponents::Insert(uint32_t slot, int64_t cost_ns) {
  Grow(slot);
  if (component_[slot] != kNone) return;
  const uint32_t g = NewGroup();
  groups_[g].cost = cost_ns;
  groups_[g].members.assign(1, slot);
  component_[slot] = g;
  position_[slot] = 0;
  own_cost_[slot] = cost_ns;
  ++count_;
}

void EvictedComponents::Union(uint32_t a, uint32_t b) {
  uint32_t ga = component_[a];
  uint32_t gb = component_[b];
  if (ga == gb) return;
  if (groups_[ga].members.size() < groups_[gb].members.size()) {
    std::swap(ga, gb);
  }
  Group& big = groups_[ga];
  Group& small = groups_[gb];
  for (uint32_t m : small.members) {
    component_[m] = ga;
    position_[m] = static_cast<uint32_t>(big.members.size());
    big.members.push_back(m);
  }
  big.cost += small.cost;
  small = Group{};
  free_groups_.push_back(gb);
}

void EvictedComponents::DropMember(uint32_t slot) {
  const uint32_t g = component_[slot];
  Group& group = groups_[g];
  const uint32_t last = group.members.back();
  group.members[position_[slot]] = last;
  position_[last] = position_[slot];
  group.members.pop_back();
  group.cost -= own_cost_[slot];
  component_[slot] = kNone;
  --count_;
  if (group.members.empty()) {
    group = Group{};
    free_groups_.push_back(g);
  }
}

void EvictedComponents::Erase(uint32_t slot, NeighbourFn neighbours) {
  if (!Contains(slot)) return;
  int inside = 0;
  neighbours(slot, [&](uint32_t n) { inside += Contains(n) ? 1 : 0; });
  if (inside <= 1) {  // a leaf of its component: the rest stays connected
    DropMember(slot);
    return;
  }
  // It may have joined parts that are now apart: re-form from adjacency.
  const uint32_t g = component_[slot];
  std::vector<uint32_t> rest = std::move(groups_[g].members);
  groups_[g] = Group{};
  free_groups_.push_back(g);
  for (uint32_t m : rest) component_[m] = kNone;
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
