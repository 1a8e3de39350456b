#ifndef DELTAD_DAEMON_PREFETCH_ORDER_H_
#define DELTAD_DAEMON_PREFETCH_ORDER_H_

#include <cstdint>

#include "policies/access_plan.h"

namespace deltad::daemon {

// Which order a session's prefetches follow: DELTA's queue (newest
// offloaded first, the order backward consumes forward activations), or
// the order its last iteration read its tensors in (the out-of-core
// paper's replay). Neither wins everywhere (the simulator's `delta-replay`
// is ahead of `delta` on some random layer graphs and behind on others),
// so each session tries both on its own iterations and keeps the faster:
// the first iteration records, the second replays, the third uses the
// queue, and from the fourth on the faster of those two is followed.
// Iterations end where the process says so (EventBatch.iteration_peak_bytes)
// and are timed by the daemon's clock between those batches.
//
// A plan that stops matching (another shape, data-dependent control flow)
// stops naming the tensors the process reads, and its look-ahead finds
// nothing offloaded; an iteration with more accesses than
// `max_accesses` is not recorded, and the queue is used after it.
// Not thread safe.
class PrefetchOrder {
 public:
  // `max_accesses` bounds what one iteration's record holds (memory a
  // session can make the daemon keep); `window_fraction` of the budget is
  // what the replay looks ahead (0 turns the replay off).
  PrefetchOrder(int64_t max_accesses, double window_fraction)
      : max_accesses_(max_accesses), window_fraction_(window_fraction) {}

  // A tensor with stable key `key` (0: none, not recorded) was read.
  void OnAccess(uint64_t key, int64_t bytes);
  // True when this ends the trial: choice() is decided from now on.
  bool EndIteration(int64_t now_ns);

  // The plan to follow now, or nullptr for the queue.
  const policy::AccessPlan* plan() const;
  // The replay's look-ahead for a session with this budget.
  int64_t WindowBytes(int64_t budget_bytes) const;

  bool enabled() const { return window_fraction_ > 0; }
  enum class Choice { kUndecided, kQueue, kReplay };
  Choice choice() const { return choice_; }
  int64_t iterations() const { return iterations_; }
  // The two trial iterations' times; -1 until measured.
  int64_t replay_ns() const { return replay_ns_; }
  int64_t queue_ns() const { return queue_ns_; }

 private:
  int64_t max_accesses_;
  double window_fraction_;
  policy::AccessPlan plan_;
  int64_t recorded_ = 0;  // accesses in this iteration's record
  bool overflowed_ = false;
  int64_t iterations_ = 0;  // ended
  int64_t iteration_start_ns_ = 0;
  bool replaying_ = false;  // in the iteration under way
  int64_t replay_ns_ = -1;
  int64_t queue_ns_ = -1;
  Choice choice_ = Choice::kUndecided;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_PREFETCH_ORDER_H_
