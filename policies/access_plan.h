#ifndef DELTAD_POLICIES_ACCESS_PLAN_H_
#define DELTAD_POLICIES_ACCESS_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace deltad::policy {

// The access order of the previous training iteration, used as the plan for
// the current one (out-of-core paper §3: training repeats the same order).
// Accesses are recorded by stable key; the cursor follows the current
// iteration through the previous one's order. Not thread safe.
class AccessPlan {
 public:
  struct Entry {
    uint64_t key;
    int64_t bytes;
  };

  // Appends an access of the iteration in progress and advances the cursor
  // to the next occurrence of `key` in the plan.
  void Record(uint64_t key, int64_t bytes);
  // The recorded iteration becomes the plan; the cursor goes back to start.
  void EndIteration();

  // Keys the plan expects after the cursor, in order, while their summed
  // bytes stay within `window_bytes` (the first one is always included).
  std::vector<Entry> LookAhead(int64_t window_bytes) const;

  bool has_plan() const { return !plan_.empty(); }
  // How many accesses from the cursor until the plan's next access of `key`
  // (1: the next one). One the plan expects no more in this iteration comes
  // in the next, where this one began: the rest of the plan and its first
  // occurrence. -1 when the plan has no access of it.
  int64_t AccessesUntilNext(uint64_t key) const;
  size_t cursor() const { return cursor_; }
  size_t plan_size() const { return plan_.size(); }

 private:
  std::vector<Entry> plan_;
  static constexpr uint32_t kNone = UINT32_MAX;
  // Per key, its next occurrence in plan_ not yet passed by the cursor;
  // next_[i], the occurrence of plan_[i]'s key after i (kNone: none).
  // Per key, also its first occurrence in plan_ (where the next iteration
  // uses it again), in the same entry: no larger than one index alone.
  struct Occurrences {
    uint32_t next;   // first_ as above
    uint32_t first;  // in the whole plan
  };
  absl::flat_hash_map<uint64_t, Occurrences> first_;
  std::vector<uint32_t> next_;
  std::vector<Entry> recording_;
  size_t cursor_ = 0;  // index in plan_ of the next expected access
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_ACCESS_PLAN_H_
