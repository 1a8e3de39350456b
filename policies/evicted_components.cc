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
  reached_by_.resize(n, 0);
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
  seen_.Clear(component_.size());
  starts_.clear();
  neighbours(slot, [&](uint32_t n) {
    // A neighbour listed twice starts one search.
    if (n == slot || !Contains(n) || !seen_.insert(n)) return;
    starts_.push_back(n);
  });
  DropMember(slot);
  // With one neighbour inside at most it was a leaf of its component: the
  // rest stays connected.
  if (starts_.size() > kMaxSearches) {
    // A hub (an optimizer step's output lists every parameter's tensors):
    // each round of the searches would walk hundreds of them.
    Reform(starts_[0], neighbours);
  } else if (starts_.size() > 1) {
    Split(starts_, neighbours);
  }
}

void EvictedComponents::Reform(uint32_t member, NeighbourFn neighbours) {
  const uint32_t g = component_[member];
  std::vector<uint32_t> rest = std::move(groups_[g].members);
  groups_[g] = Group{};
  free_groups_.push_back(g);
  for (uint32_t m : rest) component_[m] = kNone;
  count_ -= rest.size();
  for (uint32_t m : rest) Insert(m, own_cost_[m]);
  for (uint32_t m : rest) {
    neighbours(m, [&](uint32_t n) {
      if (Contains(n)) Union(m, n);
    });
  }
}

uint32_t EvictedComponents::Joined(uint32_t search) {
  uint32_t root = search;
  while (searches_[root].joined != root) root = searches_[root].joined;
  // Written only where it changes: most calls find their search one step
  // from the root, and the stores cost more than the walk.
  while (searches_[search].joined != root) {
    const uint32_t next = searches_[search].joined;
    searches_[search].joined = root;
    search = next;
  }
  return root;
}

void EvictedComponents::Split(const std::vector<uint32_t>& starts,
                              NeighbourFn neighbours) {
  const auto k = static_cast<uint32_t>(starts.size());
  if (searches_.size() < k) searches_.resize(k);
  for (uint32_t i = 0; i < k; ++i) {
    Search& search = searches_[i];
    search.reached.assign(1, starts[i]);
    search.expanded = 0;
    search.joined = i;
    reached_by_[starts[i]] = i;
  }
  // One member per going search per round, until at most one part is still
  // being searched: a search that ran out without meeting another has
  // found a whole part, cut off from the rest.
  auto parts_going = [&] {
    uint32_t first = kNone;
    for (uint32_t i = 0; i < k; ++i) {
      if (!searches_[i].going()) continue;
      const uint32_t part = Joined(i);
      if (first == kNone) {
        first = part;
      } else if (part != first) {
        return 2;
      }
    }
    return first == kNone ? 0 : 1;
  };
  while (parts_going() > 1) {
    for (uint32_t i = 0; i < k; ++i) {
      if (!searches_[i].going()) continue;
      const uint32_t m = searches_[i].reached[searches_[i].expanded++];
      // The part of this search, and of the last search met (a member's
      // neighbours were mostly reached by one search): Joined once per
      // change rather than per neighbour.
      uint32_t mine = Joined(i);
      uint32_t met = kNone;
      uint32_t met_part = kNone;
      neighbours(m, [&](uint32_t n) {
        if (!Contains(n)) return;
        if (seen_.insert(n)) {
          reached_by_[n] = i;
          searches_[i].reached.push_back(n);
          return;
        }
        if (reached_by_[n] == i) return;
        if (reached_by_[n] != met) {
          met = reached_by_[n];
          met_part = Joined(met);
        }
        if (met_part != mine) {  // the two searches are in one part
          searches_[mine].joined = met_part;
          mine = met_part;
        }
      });
    }
  }
  // The part still being searched keeps the component; if every search
  // ran out, the part that reached the most does.
  uint32_t keep = kNone;
  size_t most = 0;
  for (uint32_t i = 0; i < k; ++i) {
    if (searches_[i].going()) {
      keep = Joined(i);
      break;
    }
    size_t reached = 0;
    for (uint32_t j = 0; j < k; ++j) {
      if (Joined(j) == Joined(i)) reached += searches_[j].reached.size();
    }
    if (keep == kNone || reached > most) {
      keep = Joined(i);
      most = reached;
    }
  }
  for (uint32_t part = 0; part < k; ++part) {
    if (Joined(part) != part || part == keep) continue;
    const uint32_t ng = NewGroup();  // may move groups_: no references kept
    for (uint32_t i = 0; i < k; ++i) {
      if (Joined(i) != part) continue;
      for (uint32_t m : searches_[i].reached) {
        const int64_t cost = own_cost_[m];
        DropMember(m);
        component_[m] = ng;
        position_[m] = static_cast<uint32_t>(groups_[ng].members.size());
        groups_[ng].members.push_back(m);
        groups_[ng].cost += cost;
        ++count_;
      }
    }
  }
}

}  // namespace deltad::policy
