#include "policies/access_plan.h"

#include <algorithm>
#include <utility>

namespace deltad::policy {

void AccessPlan::Record(uint64_t key, int64_t bytes) {
  recording_.push_back({key, bytes});
  auto it = positions_.find(key);
  if (it == positions_.end()) return;  // not in the plan: the cursor stays
  const std::vector<size_t>& pos = it->second;
  auto next = std::lower_bound(pos.begin(), pos.end(), cursor_);
  if (next != pos.end()) cursor_ = *next + 1;
}

void AccessPlan::EndIteration() {
  plan_ = std::move(recording_);
  recording_.clear();
  recording_.reserve(plan_.size());
  positions_.clear();
  for (size_t i = 0; i < plan_.size(); ++i) {
    positions_[plan_[i].key].push_back(i);
  }
  cursor_ = 0;
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
