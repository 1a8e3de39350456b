#ifndef DELTAD_POLICIES_EVICTED_COMPONENTS_H_
#define DELTAD_POLICIES_EVICTED_COMPONENTS_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"

namespace deltad::policy {

// Union-find over the tensors that are not on the GPU and would have to be
// recomputed (evicted, or freed but still needed by a child): each connected
// group of such tensors is one component with the summed compute cost of its
// members. This is DTR's "equivalence class" approximation of the evicted
// neighbourhood, in amortised near-constant time.
//
// Union-find cannot split a set, which is why the DTR prototype kept stale
// links when a member was recomputed. Here every root keeps its member list,
// and Erase() rebuilds the component from the remaining members' adjacency,
// so costs stay exact after a recompute.
//
// Keys are the table's slot numbers. Not thread safe.
class EvictedComponents {
 public:
  // Calls `visit(neighbour)` for every neighbour slot of `slot`.
  using NeighbourFn = absl::FunctionRef<void(
      uint32_t slot, absl::FunctionRef<void(uint32_t neighbour)> visit)>;

  // Makes `slot` a member on its own with the given cost.
  void Insert(uint32_t slot, int64_t cost_ns);
  // Joins the components of two members.
  void Union(uint32_t a, uint32_t b);
  // Removes `slot` and re-forms what is left of its component, joining only
  // members that are still adjacent through members.
  void Erase(uint32_t slot, NeighbourFn neighbours);

  bool Contains(uint32_t slot) const {
    return slot < parent_.size() && parent_[slot] != kNone;
  }
  // Root of a member's component. Compresses paths, hence non-const state.
  uint32_t Find(uint32_t slot) const;
  // Summed compute cost of the component whose root is `root`.
  int64_t RootCost(uint32_t root) const { return cost_[root]; }
  const std::vector<uint32_t>& RootMembers(uint32_t root) const {
    return members_[root];
  }
  size_t size() const { return count_; }

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  void Grow(uint32_t slot);

  mutable std::vector<uint32_t> parent_;  // kNone: not a member
  std::vector<int64_t> own_cost_;
  std::vector<int64_t> cost_;                   // valid at roots
  std::vector<std::vector<uint32_t>> members_;  // valid at roots
  size_t count_ = 0;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_EVICTED_COMPONENTS_H_
