#ifndef DELTAD_POLICIES_SIM_DYNAMIC_POLICY_H_
#define DELTAD_POLICIES_SIM_DYNAMIC_POLICY_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "policies/access_plan.h"
#include "policies/cost_model.h"
#include "policies/director.h"
#include "policies/filter.h"
#include "policies/prefetcher.h"
#include "policies/release_planner.h"
#include "policies/sim/simulator.h"
#include "policies/tensor_table.h"
#include "policies/watermarks.h"

namespace deltad::sim {

// What happens when memory in use passes the high watermark during the
// forward pass.
enum class EarlyRelease {
  kNone,          // nothing: release only when an allocation needs room
  kOffloadAhead,  // offload what the Director would offload, so the copies
                  // overlap compute (ReleasePlanner::OffloadAhead)
  kRelease,       // release down to the low watermark (DELTA Algorithm 1)
};

struct DynamicPolicyOptions {
  std::string name = "delta";
  policy::FilterOptions filter;
  bool allow_offload = true;
  bool allow_evict = true;
  EarlyRelease early_release = EarlyRelease::kNone;
  double high_watermark = policy::Watermarks::kDefaultHigh;
  double low_watermark = policy::Watermarks::kDefaultLow;
  // Reload offloaded tensors ahead of use during the backward pass.
  bool prefetch = true;
  int max_prefetch_in_flight = 2;
  // Follow the previous iteration's access order this many bytes ahead
  // (0: Algorithm 4's queue only). Needs iterations >= 2.
  double replay_window_fraction = 0;
  // Let the Director choose recompute over reload for offloaded tensors.
  bool director_restore = true;
  // In the forward pass, while the link to the host is idle, copy the
  // oldest tensors still alive to the host and keep them on the device
  // (SimContext::CopyAhead). Once a copy lands, the Filter and the
  // Director price that tensor's offload at its reload alone
  // (TensorFlags::host_copy): releasing it waits for no copy.
  bool copy_ahead = false;
  // Price a rebuild's offloaded ancestors at their restore
  // (CostModel::SetPriceOffloadedAncestors) in the Filter's delta_cost:
  // what to release. The Director's F leaves them out (pricing them there
  // too offloads more and costs the largest batches host room: ResNet-50
  // under delta-paper and delta-steady fitted 7% less). Without offloads it
  // changes nothing.
  bool price_offloaded_ancestors = true;
};

// The policy library driven by the simulator exactly as the daemon drives
// it: every storage is a tensor in a TensorTable; releases come from the
// ReleasePlanner (Filter + Director), prefetches from the Prefetcher. The
// configurations delta, delta-paper, delta-replay, dtr, dtr-sampled and
// swap-lru differ only in options. Not thread safe.
class DynamicPolicy final : public SimPolicy {
 public:
  explicit DynamicPolicy(DynamicPolicyOptions options);

  std::string name() const override { return options_.name; }
  void BeginIteration(SimContext& ctx) override;
  void AfterStep(SimContext& ctx, int32_t step) override;
  void OnCreate(SimContext& ctx, int32_t s) override;
  void OnAccess(SimContext& ctx, int32_t s) override;
  void OnHostCopyDropped(SimContext& ctx, int32_t s) override;
  void OnStateChange(SimContext& ctx, int32_t s, StorageState from,
                     StorageState to) override;
  bool MakeRoom(SimContext& ctx, int64_t bytes) override;
  Restore ChooseRestore(SimContext& ctx, int32_t s, int64_t reload_ns) override;

  // With replay_window_fraction > 0: the access order of an iteration seen
  // elsewhere (storages, in order) becomes the plan its first iteration
  // prefetches by, as if it had run that iteration itself.
  void SeedAccessOrder(const Program& program,
                       const std::vector<int32_t>& accesses);

  // From now on, prefetch as delta-replay does with `window_fraction`: the
  // iteration `accesses` recorded is the order this one prefetches by, and
  // each iteration records its own for the next. The policy keeps all it
  // has learnt, as delta-replay run from the start would have. Call it
  // after BeginIteration. StopReplay goes back to DELTA's queue.
  void ReplayAccessOrder(const Program& program,
                         const std::vector<int32_t>& accesses,
                         double window_fraction);
  void StopReplay() { options_.replay_window_fraction = 0; }

  // While another policy decides and this one only follows (a steady-state
  // plan's fallback), its table rebuilds the evicted components when it
  // needs them instead of keeping them at every change
  // (TensorTable::DeferComponents). Decisions are the same either way.
  void FollowOnly(bool follow) { table_.DeferComponents(follow); }

  // The first time the policy's table refused a change the simulator made:
  // the mirror and the simulation disagree, a bug. OK when they never did.
  absl::Status Consistency() const override { return mirror_status_; }

 private:
  policy::TensorId IdOf(int32_t s) const;
  void Check(const absl::Status& status);
  bool Release(SimContext& ctx, int64_t bytes);
  void OffloadAhead(SimContext& ctx, int64_t bytes);
  // Starts copies ahead while the link would otherwise be idle.
  void CopyAhead(SimContext& ctx, int32_t step);
  // Tells the table which copies have landed since the last decision.
  void MarkLandedCopies(SimContext& ctx);
  std::vector<policy::TensorId> LockInUse(SimContext& ctx);

  DynamicPolicyOptions options_;
  policy::TensorTable table_;
  policy::CostModel costs_;
  policy::Filter filter_;
  policy::Director director_;
  policy::Watermarks watermarks_;
  std::optional<policy::Prefetcher> prefetcher_;
  policy::AccessPlan plan_;
  std::vector<policy::TensorId> ids_;  // storage -> tensor id (0: none)
  policy::TensorSpec spec_;            // OnCreate's, reused
  policy::TensorId next_id_ = 1;
  bool first_iteration_ = true;
  absl::Status mirror_status_;
  // copy_ahead: the forward pass's storages in creation order, not yet
  // copied, and those whose copy is in flight, in the order issued.
  std::deque<int32_t> to_copy_;
  std::deque<int32_t> copying_;
};

// The named configurations: delta, delta-paper, delta-replay, dtr,
// dtr-sampled, swap-lru; and the ablations delta-nocopy, delta-ahead and
// delta-sampled (see their comment).
std::optional<DynamicPolicyOptions> DynamicPolicyPreset(
    const std::string& name);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_DYNAMIC_POLICY_H_
