#ifndef DELTAD_DAEMON_GPU_ARBITER_H_
#define DELTAD_DAEMON_GPU_ARBITER_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/session_id.h"

namespace deltad::daemon {

struct BudgetChange {
  SessionId session = 0;
  int64_t budget_bytes = 0;
};

// Splits one GPU's budget among the sessions on it: weighted fair share with
// a guaranteed minimum, rebalanced whenever a session comes or goes.
//
// Each session first gets its floor, min(demand, guaranteed minimum); what
// is left is shared by weight among the sessions that want more, capped at
// each one's request, the surplus of a capped session flowing to the others
// (water-filling). A session is admitted only if every floor still fits, so
// no admission can push an existing session below its guaranteed minimum.
//
// Not thread safe: the daemon serialises calls per GPU.
class GpuArbiter {
 public:
  // InvalidArgument unless budget > 0 and 0 <= min_session <= budget.
  static absl::StatusOr<GpuArbiter> Create(int gpu, int64_t budget_bytes,
                                           int64_t min_session_bytes);

  // Admits a session. `requested` 0 asks for as much as fairness gives;
  // weight 0 counts as 1. Returns every session's new budget that changed,
  // the new session's first. RESOURCE_EXHAUSTED when the floors would not
  // fit; ALREADY_EXISTS for a known session.
  absl::StatusOr<std::vector<BudgetChange>> AddSession(SessionId session,
                                                       uint32_t weight,
                                                       int64_t requested);
  // Removes a session and returns the budgets that grew. NOT_FOUND when
  // unknown.
  absl::StatusOr<std::vector<BudgetChange>> RemoveSession(SessionId session);

  // 0 for an unknown session.
  int64_t BudgetOf(SessionId session) const;
  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t granted_bytes() const;
  size_t sessions() const { return sessions_.size(); }

 private:
  struct Entry {
    uint32_t weight = 1;
    int64_t requested = 0;  // 0: unbounded
    int64_t budget = 0;
  };

  GpuArbiter(int gpu, int64_t budget, int64_t min_session)
      : gpu_(gpu), budget_bytes_(budget), min_session_bytes_(min_session) {}
  int64_t Floor(const Entry& e) const;
  // Recomputes every budget; returns those that changed.
  std::vector<BudgetChange> Rebalance();

  int gpu_;
  int64_t budget_bytes_;
  int64_t min_session_bytes_;
  std::map<SessionId, Entry> sessions_;  // ordered: deterministic splits
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_GPU_ARBITER_H_
