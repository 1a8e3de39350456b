#ifndef DELTAD_POLICIES_SIM_SIMULATOR_H_
#define DELTAD_POLICIES_SIM_SIMULATOR_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/sim/allocator_model.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"

namespace deltad::sim {

enum class StorageState : uint8_t {
  kAbsent,      // not created yet in this iteration
  kResident,    // on the device
  kOffloading,  // on the device, copy to the host in flight
  kOffloaded,   // on the host only
  kReloading,   // copy back in flight (device memory already taken)
  kEvicted,     // nowhere; recompute from parents
  kDead,        // dropped by the trace (may be recomputed for a child)
};

enum class Restore { kReload, kRecompute };

// A resident storage's copy on the host, made ahead of need (CopyAhead).
enum class HostCopy : uint8_t { kNone, kCopying, kLanded };

struct SimOptions {
  int64_t budget_bytes = 0;
  int64_t host_bytes = int64_t{1} << 40;  // pinned host pool
  AllocatorKind allocator = AllocatorKind::kExact;
  int64_t chunk_bytes = int64_t{2} << 20;  // for AllocatorKind::kVmChunks
  // A reloaded storage that the forward pass made keeps its host bytes as a
  // copy made ahead (until the host pool needs them), so that releasing it
  // again waits for no copy: a prefetch that came too early and is pushed
  // out again costs nothing. (The client keeps those of tensors marked
  // read only, which the forward pass makes.)
  bool keep_reloaded_copies = true;
  // Iterations run back to back; the last one is measured (earlier ones let
  // replay plans learn the access order).
  int iterations = 1;
  // When > 0, the run gives up (fits = false, gave_up = true) once its
  // measured (last) iteration can no longer take less: that iteration's
  // time so far and the op time of its steps still to come reach it. A
  // planner comparing candidates needs no more of one that can no longer
  // beat the best so far.
  int64_t give_up_at_ns = 0;
  // When set, read at every step in place of give_up_at_ns: runs on other
  // threads lower it as they find faster plans.
  const std::atomic<int64_t>* shared_give_up_at_ns = nullptr;
};

struct SimResult {
  std::string policy;
  bool fits = false;
  bool gave_up = false;  // reached SimOptions::give_up_at_ns
  std::string failure;   // why it did not fit
  int64_t budget_bytes = 0;
  int64_t min_budget_bytes = 0;  // the largest single step
  int64_t peak_bytes = 0;        // the allocator's largest footprint
  int64_t makespan_ns = 0;       // of the measured iteration
  // Every iteration's, the first included: what a run of `iterations`
  // training steps takes (steady-state plans pay for their first).
  int64_t total_makespan_ns = 0;
  int iterations = 0;  // run to the end
  // The policy's own planning, wall time on the simulating machine (it
  // would run beside training, off its critical path), and the CPU time of
  // the threads it planned on (more than the wall time where they ran at
  // once).
  int64_t planning_ns = 0;
  int64_t planning_cpu_ns = 0;
  int64_t compute_ns = 0;  // ideal: the sum of op times
  int64_t recompute_ns = 0;
  int64_t stall_ns = 0;  // compute waiting for copies or memory
  int64_t d2h_bytes = 0;
  int64_t h2d_bytes = 0;
  int64_t offloads = 0;
  // Copies started ahead of need (CopyAhead), and of them those whose
  // storage was offloaded from its landed copy, with no wait.
  int64_t copies_ahead = 0;
  int64_t offloads_from_copies = 0;
  int64_t reloads = 0;  // on demand and prefetched
  int64_t prefetches = 0;
  int64_t evictions = 0;
  int64_t recomputes = 0;
  // Times the free bytes were enough but in pieces, after the policy had
  // released what it would, and the simulator freed the blocks of one range
  // to hold the allocation (Engine::FreeRangeFor).
  int64_t range_releases = 0;
  double slowdown() const {
    return compute_ns > 0 ? static_cast<double>(makespan_ns) /
                                static_cast<double>(compute_ns)
                          : 0.0;
  }
  // Over all iterations run, against as many ideal ones.
  double total_slowdown() const {
    return compute_ns > 0 && iterations > 0
               ? static_cast<double>(total_makespan_ns) /
                     (static_cast<double>(compute_ns) * iterations)
               : 0.0;
  }
};

class SimPolicy;

// What a policy sees of a running simulation and the actions it may take.
// Owned by the simulator; valid during the callbacks only.
class SimContext {
 public:
  virtual ~SimContext() = default;
  virtual const Program& program() const = 0;
  virtual const DeviceProfile& device() const = 0;
  virtual int64_t now_ns() const = 0;
  virtual int32_t step() const = 0;  // the step being run (or next)
  virtual int iteration() const = 0;
  virtual StorageState state(int32_t s) const = 0;
  virtual bool locked(int32_t s) const = 0;  // in use by the current op
  // Every storage locked now (the current op's and a recompute's inputs).
  virtual const std::vector<int32_t>& locked_storages() const = 0;
  virtual int64_t budget() const = 0;
  virtual const SimOptions& options() const = 0;
  virtual int64_t device_used() const = 0;
  virtual int64_t releasing_bytes() const = 0;  // offloads in flight
  // Pinned host bytes an offload can take: copies made ahead of resident
  // storages count as free, since they give way to one.
  virtual int64_t host_free() const = 0;
  virtual int reloads_in_flight() const = 0;
  // When the device-to-host link has carried every copy queued so far.
  virtual int64_t d2h_free_at() const = 0;
  // A resident storage's copy made ahead (CopyAhead), or kept from its
  // reload (SimOptions::keep_reloaded_copies); kNone for others.
  // Offloading one whose copy has landed frees its memory at once.
  virtual HostCopy host_copy(int32_t s) const = 0;
  // Whether evicting `s` now would still let it be rebuilt.
  virtual bool CanEvict(int32_t s) const = 0;

  // Actions; false when the storage's state or lock forbids them.
  virtual bool Offload(int32_t s) = 0;   // async copy out; memory freed after
  virtual bool Evict(int32_t s) = 0;     // memory freed now
  virtual bool Prefetch(int32_t s) = 0;  // async copy in, if memory fits now
  // Starts copying a resident storage to the host while it stays on the
  // device, so that a later Offload needs no copy to wait for (or only the
  // rest of this one). Takes host room no one holds, which an offload short
  // of room takes back (the copies made last first); evicting or dropping
  // the storage drops its copy, and a release that needs the link drops
  // the copies not started and waits for at most a 2 MiB piece of the one
  // under way.
  virtual bool CopyAhead(int32_t s) = 0;
};

// A release policy plugged into the simulator. Callbacks come from the
// simulator's single thread.
class SimPolicy {
 public:
  virtual ~SimPolicy() = default;
  virtual std::string name() const = 0;
  virtual void BeginIteration(SimContext& /*ctx*/) {}
  virtual void BeforeStep(SimContext& /*ctx*/, int32_t /*step*/) {}
  virtual void AfterStep(SimContext& /*ctx*/, int32_t /*step*/) {}
  // A storage became resident by being created (not by reload/recompute).
  virtual void OnCreate(SimContext& /*ctx*/, int32_t /*s*/) {}
  virtual void OnAccess(SimContext& /*ctx*/, int32_t /*s*/) {}
  // A resident storage's host copy is gone (its room taken by an offload,
  // or its tensor leaving the device): releasing it needs a copy again.
  virtual void OnHostCopyDropped(SimContext& /*ctx*/, int32_t /*s*/) {}
  virtual void OnStateChange(SimContext& /*ctx*/, int32_t /*s*/,
                             StorageState /*from*/, StorageState /*to*/) {}
  // Memory is short: release at least `bytes` (Offload/Evict). False when
  // nothing more can be released.
  virtual bool MakeRoom(SimContext& ctx, int64_t bytes) = 0;
  // Whether, once MakeRoom has released what it would and the free bytes
  // are enough but in pieces, the simulator may free the blocks of one
  // range to hold the allocation (evicting what can be rebuilt, offloading
  // the rest), as the memory manager under the policy would. False for a
  // run with no memory manager.
  virtual bool FreesRanges() const { return true; }
  // An offloaded storage is needed now. `reload_ns`: how long until its
  // bytes would be back, when a copy of them is on its way already (a
  // prefetch); -1 when none is, and the policy prices the reload itself.
  virtual Restore ChooseRestore(SimContext& /*ctx*/, int32_t /*s*/,
                                int64_t /*reload_ns*/) {
    return Restore::kReload;
  }
  // Whether the policy's own bookkeeping stayed in step with the simulation:
  // the first disagreement it saw, a bug; OK when none. Simulate fails a run
  // whose policy reports one.
  virtual absl::Status Consistency() const { return absl::OkStatus(); }
  // Wall and CPU time the policy spent planning (SimResult::planning_ns).
  virtual int64_t planning_ns() const { return 0; }
  virtual int64_t planning_cpu_ns() const { return 0; }
};

// Runs `program` on `device` under `options.budget_bytes` with `policy`.
// Errors for bad options and for a policy that reports an inconsistent
// state (Internal); a run that does not fit is a result with fits = false
// and the reason.
absl::StatusOr<SimResult> Simulate(const Program& program,
                                   const DeviceProfile& device,
                                   SimPolicy& policy,
                                   const SimOptions& options);

// The trace's peak under `allocator`: the largest footprint of a run that
// releases nothing with memory to spare (program.peak_bytes for kExact;
// more where the allocator rounds or leaves holes). Every policy is given
// budgets as fractions of it. Over several iterations it can be larger
// where an allocator places blocks: a later iteration lays its tensors out
// around the parameters where the first left them.
absl::StatusOr<int64_t> UnlimitedPeak(const Program& program,
                                      const DeviceProfile& device,
                                      AllocatorKind allocator,
                                      int iterations = 1);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_SIMULATOR_H_
