#include "daemon/prefetch_order.h"

#include <cmath>

namespace deltad::daemon {

void PrefetchOrder::OnAccess(uint64_t key, int64_t bytes) {
  if (window_fraction_ <= 0 || key == 0 || overflowed_) return;
  if (recorded_ >= max_accesses_) {
    overflowed_ = true;
    return;
  }
  ++recorded_;
  plan_.Record(key, bytes);
}

bool PrefetchOrder::EndIteration(int64_t now_ns) {
  const int64_t took = now_ns - iteration_start_ns_;
  ++iterations_;
  // The first iteration has no plan and pays what every later one does
  // not (tensors made for the first time, the queue empty): only the
  // second (replayed) and the third (the queue) are compared.
  if (iterations_ == 2 && replaying_) {
    replay_ns_ = took;
  } else if (iterations_ == 3) {
    queue_ns_ = took;
    choice_ = replay_ns_ >= 0 && replay_ns_ < queue_ns_ ? Choice::kReplay
                                                        : Choice::kQueue;
  }
  if (overflowed_) {
    plan_ = policy::AccessPlan();  // its record is partial: no plan
  } else {
    plan_.EndIteration();
  }
  recorded_ = 0;
  overflowed_ = false;
  iteration_start_ns_ = now_ns;
  const int64_t next = iterations_ + 1;
  replaying_ = window_fraction_ > 0 && plan_.has_plan() &&
               (next == 2 || (next > 3 && choice_ == Choice::kReplay));
  return iterations_ == 3;
}

const policy::AccessPlan* PrefetchOrder::plan() const {
  return replaying_ ? &plan_ : nullptr;
}

int64_t PrefetchOrder::WindowBytes(int64_t budget_bytes) const {
  return static_cast<int64_t>(
      std::llround(window_fraction_ * static_cast<double>(budget_bytes)));
}

}  // namespace deltad::daemon
