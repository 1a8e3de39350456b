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

// Splits one GPU's budget among the sessions on it: weighted fair share above
// per-session floors, rebalanced whenever a session comes or goes.
//
// A session's floor is what it cannot run without, the largest of
//  - min(demand, the guaranteed minimum),
//  - what it declared when it opened (OpenSessionRequest.min_budget_bytes),
//  - the peak device bytes of its last completed iteration, as it reported
//    it (EventBatch.iteration_peak_bytes), counted up to the budget it had
//    then: memory lent past its budget is not kept as a floor.
// Each session first gets its floor; what is left is shared by weight among
// the sessions that want more, capped at each one's request, the surplus of
// a capped session flowing to the others (water-filling). A session is
// admitted only if every floor, its own included, still fits: admitting a
// newcomer never cuts a running job below its floor, so the newcomer is
// refused instead (and may try again when a job ends or its peak falls).
//
// Not thread safe: the daemon serialises calls per GPU.
class GpuArbiter {
 public:
  // Budgets are whole multiples of `unit_bytes` (the GPU's chunk size:
  // a budget is held in chunks, and a part of one could never be mapped);
  // floors and requests count in whole units, rounded up, and the GPU's
  // budget in whole units, rounded down. InvalidArgument unless budget > 0,
  // 0 <= min_session <= budget and 1 <= unit <= budget.
  static absl::StatusOr<GpuArbiter> Create(int gpu, int64_t budget_bytes,
                                           int64_t min_session_bytes,
                                           int64_t unit_bytes = 1);

  // Admits a session. `requested` 0 asks for as much as fairness gives;
  // weight 0 counts as 1; `declared_floor` is what the session says it
  // cannot run without (0: none). Returns every session's new budget that
  // changed, the new session's first. RESOURCE_EXHAUSTED, naming the
  // floors, when they would not fit; INVALID_ARGUMENT for a declared floor
  // above the request or the GPU's budget; ALREADY_EXISTS for a known
  // session.
  absl::StatusOr<std::vector<BudgetChange>> AddSession(
      SessionId session, uint32_t weight, int64_t requested,
      int64_t declared_floor = 0);
  // The session completed an iteration whose peak was `peak_bytes`: its
  // floor from now on, up to its budget. Budgets do not change (the floor
  // is within the session's budget); it counts at the next admission.
  // NOT_FOUND when unknown.
  absl::Status SetIterationPeak(SessionId session, int64_t peak_bytes);
  // The session stopped answering while holding `held_bytes`: its budget
  // is what it holds, which nobody else can have until it answers or
  // exits, and the others share the rest. Their floors are kept while the
  // rest holds them; when it does not, each is cut in proportion to its
  // floor (the memory is not there to give). Returns the budgets that
  // changed, the frozen session's included. NOT_FOUND when unknown.
  absl::StatusOr<std::vector<BudgetChange>> Freeze(SessionId session,
                                                   int64_t held_bytes);
  // It answers again: shared as before. NOT_FOUND when unknown; no change
  // for a session not frozen.
  absl::StatusOr<std::vector<BudgetChange>> Thaw(SessionId session);
  bool Frozen(SessionId session) const;
  // Memory in use on the GPU that no session's budget covers (chunks that
  // processes still map after their sessions ended): the sessions share
  // what is left. Returns the budgets that changed.
  std::vector<BudgetChange> SetOutside(int64_t bytes);
  int64_t outside_bytes() const { return outside_bytes_; }
  // Removes a session and returns the budgets that grew. NOT_FOUND when
  // unknown.
  absl::StatusOr<std::vector<BudgetChange>> RemoveSession(SessionId session);

  // 0 for an unknown session.
  int64_t BudgetOf(SessionId session) const;
  // In whole units (see Create).
  int64_t FloorOf(SessionId session) const;
  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t granted_bytes() const;
  size_t sessions() const { return sessions_.size(); }

 private:
  struct Entry {
    uint32_t weight = 1;
    int64_t requested = 0;  // 0: unbounded
    int64_t budget = 0;
    int64_t declared_floor = 0;
    int64_t iteration_peak = 0;  // the last one, capped at the budget then
    int64_t frozen_at = -1;      // >= 0: unresponsive, holding this much
  };

  GpuArbiter(int gpu, int64_t budget, int64_t min_session, int64_t unit)
      : gpu_(gpu),
        budget_bytes_(budget),
        min_session_bytes_(min_session),
        unit_bytes_(unit) {}
  int64_t Floor(const Entry& e) const;
  // Whole units that hold `bytes`, and those units in bytes.
  int64_t Units(int64_t bytes) const {
    return (bytes + unit_bytes_ - 1) / unit_bytes_;
  }
  int64_t RoundUp(int64_t bytes) const { return Units(bytes) * unit_bytes_; }
  // Recomputes every budget; returns those that changed.
  std::vector<BudgetChange> Rebalance();

  int gpu_;
  int64_t budget_bytes_;
  int64_t min_session_bytes_;
  int64_t unit_bytes_;
  int64_t outside_bytes_ = 0;
  std::map<SessionId, Entry> sessions_;  // ordered: deterministic splits
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_GPU_ARBITER_H_
