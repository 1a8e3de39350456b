#include "policies/prefetcher.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace deltad::policy {

absl::StatusOr<Prefetcher> Prefetcher::Create(PrefetchOptions options) {
  if (options.max_in_flight < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch max_in_flight must be at least 1, got ",
                     options.max_in_flight));
  }
  if (options.window_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefetch window must not be negative, got ", options.window_bytes));
  }
  return Prefetcher(options);
}

void Prefetcher::OnOffloaded(TensorId id) { queue_.push_back(id); }

std::vector<TensorId> Prefetcher::Plan(const TensorTable& table,
                                       int64_t free_bytes, int in_flight,
                                       const AccessPlan* plan,
                                       SessionId session) {
  // First, whatever is planned: the queue is consumed only when there is
  // room, and would otherwise keep every offload ever seen (and in replay
  // mode it is never consumed at all). Not on every plan (a backward step
  // plans each time, and a pass is the whole queue): once it has doubled.
  if (queue_.size() >= drop_stale_at_) DropStale(table);
  const int slots = options_.max_in_flight - in_flight;
  if (slots <= 0 || free_bytes <= 0) return {};
  if (plan == nullptr || !plan->has_plan() || options_.window_bytes == 0) {
    return PlanFromQueue(table, free_bytes, slots);
  }
  // Replay: the tensors the last iteration used next, within the window.
  std::vector<TensorId> out;
  for (const AccessPlan::Entry& e : plan->LookAhead(options_.window_bytes)) {
    if (static_cast<int>(out.size()) == slots) break;
    const Tensor* t = table.FindByKey(session, e.key);
    if (t == nullptr || t->state != TensorState::kOffloaded) continue;
    if (std::find(out.begin(), out.end(), t->id) != out.end()) continue;
    if (t->bytes > free_bytes) break;  // keep plan order: no skipping ahead
    free_bytes -= t->bytes;
    out.push_back(t->id);
  }
  return out;
}

void Prefetcher::DropStale(const TensorTable& table) {
  // Newest to oldest, compacting towards the back; the rest keep their order.
  absl::flat_hash_set<TensorId> seen;
  size_t keep = queue_.size();
  for (size_t i = queue_.size(); i-- > 0;) {
    const Tensor* t = table.Find(queue_[i]);
    if (t == nullptr || t->state != TensorState::kOffloaded) continue;
    if (!seen.insert(queue_[i]).second) continue;  // offloaded twice
    queue_[--keep] = queue_[i];
  }
  queue_.erase(queue_.begin(), queue_.begin() + static_cast<ptrdiff_t>(keep));
  drop_stale_at_ = std::max<size_t>(64, 2 * queue_.size());
}

std::vector<TensorId> Prefetcher::PlanFromQueue(const TensorTable& table,
                                                int64_t free_bytes, int slots) {
  std::vector<TensorId> out;
  // "while memory is enough and reload_count < n" (Algorithm 4 prints "or",
  // which would reload without bound whenever memory is free).
  while (!queue_.empty() && static_cast<int>(out.size()) < slots) {
    const Tensor* t = table.Find(queue_.back());
    // Stale (DropStale has not run since), or offloaded twice: queued twice.
    if (t == nullptr || t->state != TensorState::kOffloaded ||
        std::find(out.begin(), out.end(), t->id) != out.end()) {
      queue_.pop_back();
      continue;
    }
    if (t->bytes > free_bytes) break;
    free_bytes -= t->bytes;
    out.push_back(t->id);
    queue_.pop_back();
  }
  return out;
}

}  // namespace deltad::policy
