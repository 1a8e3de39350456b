#ifndef DELTAD_POLICIES_SIM_STEADY_STATE_POLICY_H_
#define DELTAD_POLICIES_SIM_STEADY_STATE_POLICY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "policies/sim/dynamic_policy.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

// Training repeats itself: after one iteration the whole access sequence is
// known. `delta-steady` runs the dynamic `delta` policy for the first
// iteration while it records the storages accessed, in order. It plans at
// the start of the first iteration after one slower than its ideal time
// (the second, wherever `delta` stalled or recomputed in the first): it
// replays the recorded iteration three times in the
// simulator under `delta` and under each candidate (delta-replay: `delta`
// prefetching in the order its last iteration read; DELTA as published,
// DTR, and the static planners offload-greedy and window) with the
// run's budget, host memory and allocator model, and follows the one whose
// third iteration finishes first (`delta` where none beats it). For
// delta-replay, `delta` itself turns to prefetching in the recorded order,
// keeping all it learnt.
// Planning happens once, at the start of the second iteration, and reports
// its wall and CPU time (planning_ns, planning_cpu_ns); in a real process
// it would run beside training, off its critical path. The replays are
// independent and run on up to `planner_threads` threads at once (0: one
// per core); the plan chosen does not depend on how many.
//
// While a plan runs, every access is checked against the recording; the
// first one that differs (another shape, data-dependent control flow)
// abandons the plan at once and `delta` decides from there on, as it does
// whenever the plan cannot make room. `delta` sees every event throughout,
// so its table is always current.
class SteadyStatePolicy final : public SimPolicy {
 public:
  explicit SteadyStatePolicy(int planner_threads = 0);
  // The threads planning runs on by default: one per core.
  static int DefaultPlannerThreads();
  // A plan is judged by the last of this many replayed iterations (why:
  // steady_state_policy.cc).
  static constexpr int kReplayIterations = 3;
  ~SteadyStatePolicy() override;

  std::string name() const override { return "delta-steady"; }
  void BeginIteration(SimContext& ctx) override;
  void BeforeStep(SimContext& ctx, int32_t step) override;
  void AfterStep(SimContext& ctx, int32_t step) override;
  void OnCreate(SimContext& ctx, int32_t s) override;
  void OnAccess(SimContext& ctx, int32_t s) override;
  void OnHostCopyDropped(SimContext& ctx, int32_t s) override;
  void OnStateChange(SimContext& ctx, int32_t s, StorageState from,
                     StorageState to) override;
  bool MakeRoom(SimContext& ctx, int64_t bytes) override;
  Restore ChooseRestore(SimContext& ctx, int32_t s, int64_t reload_ns) override;
  absl::Status Consistency() const override;
  int64_t planning_ns() const override { return planning_ns_; }
  int64_t planning_cpu_ns() const override { return planning_cpu_ns_; }

  // The plan followed now ("delta" before one is chosen or once abandoned).
  const std::string& following() const { return following_; }
  int abandoned() const { return abandoned_; }
  // How many plans were replayed, `delta`'s included: the search ends at
  // the first that runs the recorded iteration in its ideal time (on one
  // thread; replays already running on others finish or give up).
  int replayed() const { return replayed_; }

 private:
  void Plan(SimContext& ctx);
  // Shows the plan chosen the storages that outlive an iteration.
  void Adopt(SimContext& ctx);
  void Abandon();
  bool planned() const { return plan_ != nullptr; }

  std::unique_ptr<DynamicPolicy> delta_;  // the fallback, fed every event
  std::unique_ptr<SimPolicy> plan_;       // the chosen planner, if not delta
  std::string following_ = "delta";
  // `delta` prefetches in the recorded order (following delta-replay).
  bool replaying_ = false;
  int iteration_ = 0;
  int64_t iteration_start_ns_ = 0;
  bool decided_ = false;
  // The accesses of the first iteration, then the position in them.
  std::vector<int32_t> recorded_;
  size_t position_ = 0;
  int planner_threads_;
  int64_t planning_ns_ = 0;
  int64_t planning_cpu_ns_ = 0;
  int abandoned_ = 0;
  int replayed_ = 0;
};

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_STEADY_STATE_POLICY_H_
