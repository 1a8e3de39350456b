#ifndef DELTAD_POLICIES_SIM_ENGINE_H_
#define DELTAD_POLICIES_SIM_ENGINE_H_

// The simulator's engine, shared by its two source files: simulator.cc runs
// the iterations (steps, materialising, recompute), engine_actions.cc holds
// what a policy can do (offload, evict, prefetch, copy ahead) and the copy
// engines' clock. Internal to the simulator: use Simulate().

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "policies/sim/allocator_model.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim::engine_internal {

inline constexpr int64_t kWorkspaceId = -1;
// A copy made ahead goes out in pieces of this size (the client's device
// chunk), so a release that needs the link waits for one piece at most.
inline constexpr int64_t kAheadChunkBytes = int64_t{2} << 20;

// One copy engine: transfers run in issue order, each after the last.
struct CopyEngine {
  struct Transfer {
    int32_t storage;
    int64_t end_ns;
    uint32_t generation;  // stale when the storage's generation moved on
  };
  std::deque<Transfer> queue;
  int64_t free_at = 0;
};

class Engine final : public SimContext {
 public:
  Engine(const Program& program, const DeviceProfile& device, SimPolicy& policy,
         const SimOptions& options)
      : program_(program),
        device_(device),
        policy_(policy),
        options_(options),
        state_(program.storages.size(), StorageState::kAbsent),
        locks_(program.storages.size(), 0),
        generation_(program.storages.size(), 0),
        host_copy_(program.storages.size(), HostCopy::kNone),
        allocator_(MakeAllocatorModel(options.allocator, options.budget_bytes,
                                      options.chunk_bytes)) {
    // With one copy engine both directions share its queue.
    h2d_ = device.copy_engines >= 2 ? &h2d_own_ : &d2h_;
  }

  SimResult Run();

  // --- SimContext ---------------------------------------------------------
  const Program& program() const override { return program_; }
  const DeviceProfile& device() const override { return device_; }
  int64_t now_ns() const override { return now_; }
  int32_t step() const override { return step_; }
  int iteration() const override { return iteration_; }
  StorageState state(int32_t s) const override { return state_[s]; }
  bool locked(int32_t s) const override { return locks_[s] > 0; }
  const std::vector<int32_t>& locked_storages() const override {
    return locked_list_;
  }
  int64_t budget() const override { return options_.budget_bytes; }
  const SimOptions& options() const override { return options_; }
  int64_t device_used() const override { return allocator_->used(); }
  int64_t releasing_bytes() const override { return releasing_; }
  int64_t host_free() const override {
    return options_.host_bytes - host_used_ + ahead_bytes_;
  }
  int reloads_in_flight() const override { return reloads_in_flight_; }
  int64_t d2h_free_at() const override { return d2h_.free_at; }
  HostCopy host_copy(int32_t s) const override { return host_copy_[s]; }
  bool CanEvict(int32_t s) const override;
  bool Offload(int32_t s) override;
  bool Evict(int32_t s) override;
  bool Prefetch(int32_t s) override;
  bool CopyAhead(int32_t s) override;

 private:
  void SetState(int32_t s, StorageState to);
  // Drops a resident storage's host copy, cancelling it if in flight.
  void DropHostCopy(int32_t s);
  // Drops copies made ahead, the latest first, until `bytes` of the host
  // pool are free or none is left.
  void ReclaimHost(int64_t bytes);
  // A reload has landed: its host bytes stay as a copy (SimOptions::
  // keep_reloaded_copies) or go back to the pool.
  void KeepReloadedCopy(int32_t s);
  // Makes way on the D2H link for a release (YieldCopiesAhead's comment).
  void YieldCopiesAhead();
  void Lock(int32_t s) {
    if (locks_[s]++ == 0) locked_list_.push_back(s);
  }
  void Unlock(int32_t s) {
    if (--locks_[s] == 0) {
      locked_list_.erase(
          std::find(locked_list_.begin(), locked_list_.end(), s));
    }
  }
  void Advance(int64_t t);  // completes transfers that end by t
  void StallUntil(int64_t t);
  int64_t CopyNs(int64_t bytes, double bytes_per_s) const {
    return static_cast<int64_t>(
        std::ceil(1e9 * static_cast<double>(bytes) / bytes_per_s));
  }
  // Finds room for a block; false with failure_ set when impossible.
  bool Allocate(int64_t id, int64_t bytes);
  // Frees the blocks of a range that would hold `bytes` (fragmentation);
  // false when none could be freed.
  bool FreeRangeFor(int64_t bytes);
  // An offload not landed: the storage stays on the device, its copy gone.
  void CancelOffload(int32_t s);
  void CancelReload(int32_t s);
  // Brings a storage back to the device for the current step.
  bool Materialize(int32_t s, int depth);
  bool Recompute(int32_t s, int depth);
  void FreeStorage(int32_t s);
  bool RunIteration();
  // At an iteration's start: a constant updated in place in the last one
  // takes over its final version's memory and place (device or host).
  bool CarryOver(const Carry& c);
  // An in-place result takes the memory of the storage it replaces when
  // that one loses its last name in this step: returns the replaced
  // storage (-1: none), whose death the caller reports once the policy has
  // seen the result created from it.
  int32_t TakeOverInPlace(const Step& step, int32_t created);
  void Fail(std::string why) {
    if (failure_.empty()) failure_ = std::move(why);
  }

  const Program& program_;
  const DeviceProfile& device_;
  SimPolicy& policy_;
  const SimOptions& options_;
  std::vector<StorageState> state_;
  std::vector<uint32_t> locks_;
  std::vector<uint32_t> generation_;
  std::vector<HostCopy> host_copy_;
  std::unique_ptr<AllocatorModel> allocator_;
  CopyEngine d2h_;
  CopyEngine h2d_own_;
  CopyEngine* h2d_;
  std::vector<int32_t> locked_list_;  // storages with locks_ > 0

  int64_t now_ = 0;
  int32_t step_ = 0;
  int iteration_ = 0;
  int64_t iteration_start_ = 0;  // the clock when this iteration began
  int64_t releasing_ = 0;
  int64_t host_used_ = 0;
  // Of it, the copies made ahead of resident storages: they give way to an
  // offload that needs the room (ReclaimHost), so host_free() counts them.
  int64_t ahead_bytes_ = 0;
  std::vector<int32_t> ahead_order_;  // in the order made; stale entries too
  int reloads_in_flight_ = 0;
  std::string failure_;
  bool gave_up_ = false;  // at options_.give_up_at_ns
  SimResult result_;
};

}  // namespace deltad::sim::engine_internal

#endif  // DELTAD_POLICIES_SIM_ENGINE_H_
