#ifndef DELTAD_POLICIES_EVICTED_COMPONENTS_H_
#define DELTAD_POLICIES_EVICTED_COMPONENTS_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "policies/epoch_marks.h"

namespace deltad::policy {

// The connected groups of tensors that are not on the GPU and would have to
// be recomputed (evicted, or freed but still needed by a child), each with the
// summed compute cost of its members: DTR's "equivalence classes", used for
// the evicted-neighbourhood cost in O(degree).
//
// DTR's prototype used union-find, which cannot split a set, so a recomputed
// tensor left stale links and costs behind. Here every component has an id of
// its own and a member list; union relabels the smaller side (O(log n)
// amortised per member). Removing a member with at most one neighbour inside
// its component cannot disconnect it and costs O(degree); that is the usual
// case, since recompute runs ancestors first. A member that joins two or
// more others starts a search from each of them, in turn one member at a
// time, until at most one search is still going: the finished ones are the
// parts cut off, which leave the component, and the work is bounded by the
// smaller parts rather than the component (re-forming it whole made a
// recompute-heavy run quadratic in its longest chain). Only a hub with more
// neighbours inside than kMaxSearches still re-forms its component.
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
  // Removes `slot`; what is left of its component stays one component only
  // where its members are still connected through members.
  void Erase(uint32_t slot, NeighbourFn neighbours);

  bool Contains(uint32_t slot) const {
    return slot < component_.size() && component_[slot] != kNone;
  }
  // Id of a member's component; valid until the next change.
  uint32_t ComponentOf(uint32_t slot) const { return component_[slot]; }
  int64_t Cost(uint32_t component) const { return groups_[component].cost; }
  const std::vector<uint32_t>& Members(uint32_t component) const {
    return groups_[component].members;
  }
  // Number of members.
  size_t size() const { return count_; }

 private:
  static constexpr uint32_t kNone = UINT32_MAX;
  // Past this many starts, Erase re-forms the component instead of
  // searching (measured on the Adam model traces' optimizer step).
  static constexpr size_t kMaxSearches = 16;
  struct Group {
    int64_t cost = 0;
    std::vector<uint32_t> members;
  };

  // One of Erase's searches: the members it reached, in order, and how
  // many of them it has expanded.
  struct Search {
    std::vector<uint32_t> reached;
    size_t expanded = 0;
    uint32_t joined = 0;  // the search it met (itself if none): union-find
    bool going() const { return expanded < reached.size(); }
  };

  void Grow(uint32_t slot);
  uint32_t NewGroup();
  void DropMember(uint32_t slot);
  // Re-forms the component of `member` from its members' adjacency.
  void Reform(uint32_t member, NeighbourFn neighbours);
  // Searches from every start at once (marked seen in this pass); moves the
  // parts that are cut off from their component into groups of their own.
  void Split(const std::vector<uint32_t>& starts, NeighbourFn neighbours);
  uint32_t Joined(uint32_t search);

  std::vector<uint32_t> component_;  // per slot; kNone: not a member
  std::vector<uint32_t> position_;   // per slot: index in its member list
  std::vector<int64_t> own_cost_;    // per slot
  std::vector<Group> groups_;
  std::vector<uint32_t> free_groups_;
  size_t count_ = 0;
  // Erase's scratch, kept to spare allocations: the members a search
  // reached in this Erase, and which search reached each.
  EpochMarks seen_;
  std::vector<uint32_t> reached_by_;
  std::vector<Search> searches_;
  std::vector<uint32_t> starts_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_EVICTED_COMPONENTS_H_
