#include "policies/access_plan.h"

#include <algorithm>
#include <utility>

namespace deltad::policy {

void AccessPlan::Record(uint64_t key, int64_t bytes) {
  recording_.push_back({key, bytes});
  auto it = first_.find(key);
  if (it == first_.end()) return;  // not in the plan: the cursor stays
  // The key's first occurrence at or after the cursor, walked from where the
  // last search for it stopped: the cursor only moves on, so each key's
  // list is walked once an iteration.
  uint32_t& at = it->second.next;
  while (at != kNone && at < cursor_) at = next_[at];
  if (at != kNone) cursor_ = static_cast<size_t>(at) + 1;
}

void AccessPlan::EndIteration() {
  plan_.swap(recording_);
  recording_.clear();
  // Each key's occurrences as a list threaded through one array: a few
  // allocations an iteration, where a list per key made one per distinct
  // key, every iteration of every session.
  first_.clear();
  next_.assign(plan_.size(), kNone);
  for (size_t i = plan_.size(); i-- > 0;) {
    const auto at = static_cast<uint32_t>(i);
    auto [it, added] = first_.try_emplace(plan_[i].key, Occurrences{at, at});
    if (!added) {
      next_[i] = it->second.next;
      it->second = {at, at};
    }
  }
  cursor_ = 0;
}

int64_t AccessPlan::AccessesUntilNext(uint64_t key) const {
  auto it = first_.find(key);
  if (it == first_.end()) return -1;
  // Record moves a key's first occurrence on only when the key comes up:
  // one passed by the cursor since is walked over here.
  uint32_t at = it->second.next;
  while (at != kNone && at < cursor_) at = next_[at];
  if (at != kNone) return static_cast<int64_t>(at - cursor_) + 1;
  // Not again in this iteration: in the next one, as this one began.
  return static_cast<int64_t>(plan_.size() - cursor_ + it->second.first) + 1;
}

std::vector<AccessPlan::Entry> AccessPlan::LookAhead(
    int64_t window_bytes) const {
  std::vector<Entry> out;
  int64_t used = 0;
  for (size_t i = cursor_; i < plan_.size(); ++i) {
    if (!out.empty() && used + plan_[i].bytes > window_bytes) break;
    used += plan_[i].bytes;
    out.push_back(plan_[i]);
  }
  return out;
}

}  // namespace deltad::policy
