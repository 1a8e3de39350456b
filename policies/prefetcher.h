#ifndef DELTAD_POLICIES_PREFETCHER_H_
#define DELTAD_POLICIES_PREFETCHER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "policies/access_plan.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

struct PrefetchOptions {
  // At most this many reloads in flight (DELTA Algorithm 4's n). Reloading
  // too much only gets it offloaded again (DELTA §4.2).
  int max_in_flight = 2;
  // With a replay plan: look this many bytes ahead in the previous
  // iteration's order (out-of-core paper's window). 0 disables the plan.
  int64_t window_bytes = 0;
};

// Algorithm 4 of DELTA: reload offloaded tensors ahead of use while memory
// allows and fewer than n reloads are in flight. Without a plan, the queue is
// newest-offloaded first, the order backward consumes forward activations.
// One Prefetcher per scope (a session, as the daemon runs it). Not thread
// safe; does not own the table or the plan.
class Prefetcher {
 public:
  static absl::StatusOr<Prefetcher> Create(PrefetchOptions options);

  // Queue a tensor that has just been offloaded.
  void OnOffloaded(TensorId id);

  // Tensors to reload now, in order. `free_bytes` is the memory the scope may
  // still fill; `in_flight` the reloads already running. Entries that stopped
  // being offloaded (freed, recomputed, reloaded on demand) are skipped, and
  // dropped from the queue whenever it has doubled since they last were.
  std::vector<TensorId> Plan(const TensorTable& table, int64_t free_bytes,
                             int in_flight, const AccessPlan* plan,
                             SessionId session);

  size_t queued() const { return queue_.size(); }
  // Drops entries that stopped being offloaded and repeats of a tensor
  // offloaded more than once (its newest entry stays). Plan does it too; a
  // caller that rarely plans calls it to keep the queue bounded.
  void DropStale(const TensorTable& table);

 private:
  explicit Prefetcher(PrefetchOptions options) : options_(options) {}
  std::vector<TensorId> PlanFromQueue(const TensorTable& table,
                                      int64_t free_bytes, int slots);

  PrefetchOptions options_;
  std::vector<TensorId> queue_;  // back = newest
  size_t drop_stale_at_ = 64;    // queue_'s size that calls DropStale next
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_PREFETCHER_H_
