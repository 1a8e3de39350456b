#include "policies/sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::sim {

namespace {

constexpr int64_t kWorkspaceId = -1;

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
    return options_.host_bytes - host_used_;
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
  void CancelReload(int32_t s);
  // Brings a storage back to the device for the current step.
  bool Materialize(int32_t s, int depth);
  bool Recompute(int32_t s, int depth);
  void FreeStorage(int32_t s);
  bool RunIteration();
  // An in-place result takes the memory of the storage it replaces when
  // that one loses its last name in this step.
  bool TakeOverInPlace(const Step& step, int32_t created);
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
  int64_t releasing_ = 0;
  int64_t host_used_ = 0;
  int reloads_in_flight_ = 0;
  std::string failure_;
  bool gave_up_ = false;  // at options_.give_up_at_ns
  SimResult result_;
};

void Engine::SetState(int32_t s, StorageState to) {
  const StorageState from = state_[s];
  if (from == to) return;
  state_[s] = to;
  policy_.OnStateChange(*this, s, from, to);
}

bool Engine::CanEvict(int32_t s) const {
  return state_[s] == StorageState::kResident && locks_[s] == 0 &&
         program_.Recomputable(s);
}

void Engine::DropHostCopy(int32_t s) {
  if (host_copy_[s] == HostCopy::kNone) return;
  if (host_copy_[s] == HostCopy::kCopying) ++generation_[s];  // cancelled
  host_copy_[s] = HostCopy::kNone;
  host_used_ -= program_.storages[s].bytes;
}

bool Engine::Offload(int32_t s) {
  const int64_t bytes = program_.storages[s].bytes;
  if (state_[s] != StorageState::kResident || locks_[s] > 0) return false;
  if (host_copy_[s] == HostCopy::kLanded) {
    // The copy is on the host already: the memory is free at once.
    host_copy_[s] = HostCopy::kNone;
    allocator_->Free(s);
    ++result_.offloads;
    ++result_.offloads_from_copies;
    SetState(s, StorageState::kOffloading);
    SetState(s, StorageState::kOffloaded);
    return true;
  }
  if (host_copy_[s] == HostCopy::kCopying) {
    // The copy in flight becomes the offload's: its end frees the memory.
    host_copy_[s] = HostCopy::kNone;
    releasing_ += bytes;
    ++result_.offloads;
    SetState(s, StorageState::kOffloading);
    return true;
  }
  if (host_free() < bytes) return false;
  const int64_t start = std::max(now_, d2h_.free_at);
  d2h_.free_at = start + CopyNs(bytes, device_.d2h_bytes_per_s);
  d2h_.queue.push_back({s, d2h_.free_at, ++generation_[s]});
  host_used_ += bytes;
  releasing_ += bytes;
  result_.d2h_bytes += bytes;
  ++result_.offloads;
  SetState(s, StorageState::kOffloading);
  return true;
}

bool Engine::CopyAhead(int32_t s) {
  const int64_t bytes = program_.storages[s].bytes;
  if (state_[s] != StorageState::kResident ||
      host_copy_[s] != HostCopy::kNone || host_free() < bytes) {
    return false;
  }
  const int64_t start = std::max(now_, d2h_.free_at);
  d2h_.free_at = start + CopyNs(bytes, device_.d2h_bytes_per_s);
  d2h_.queue.push_back({s, d2h_.free_at, ++generation_[s]});
  host_copy_[s] = HostCopy::kCopying;
  host_used_ += bytes;
  result_.d2h_bytes += bytes;
  ++result_.copies_ahead;
  return true;
}

bool Engine::Evict(int32_t s) {
  if (!CanEvict(s)) return false;
  DropHostCopy(s);
  allocator_->Free(s);
  ++result_.evictions;
  SetState(s, StorageState::kEvicted);
  return true;
}

bool Engine::Prefetch(int32_t s) {
  if (state_[s] != StorageState::kOffloaded) return false;
  const int64_t bytes = program_.storages[s].bytes;
  if (!allocator_->Allocate(s, bytes)) return false;
  result_.peak_bytes = std::max(result_.peak_bytes, allocator_->footprint());
  const int64_t start = std::max(now_, h2d_->free_at);
  h2d_->free_at = start + CopyNs(bytes, device_.h2d_bytes_per_s);
  h2d_->queue.push_back({s, h2d_->free_at, ++generation_[s]});
  ++reloads_in_flight_;
  result_.h2d_bytes += bytes;
  ++result_.reloads;
  ++result_.prefetches;
  SetState(s, StorageState::kReloading);
  return true;
}

void Engine::Advance(int64_t t) {
  // Complete, in time order, every transfer that has ended by t.
  for (;;) {
    CopyEngine* next = nullptr;
    for (CopyEngine* e : {&d2h_, h2d_}) {
      if (!e->queue.empty() && e->queue.front().end_ns <= t &&
          (next == nullptr ||
           e->queue.front().end_ns < next->queue.front().end_ns)) {
        next = e;
      }
    }
    if (next == nullptr) return;
    const CopyEngine::Transfer tr = next->queue.front();
    next->queue.pop_front();
    if (tr.generation != generation_[tr.storage]) continue;  // cancelled
    const int32_t s = tr.storage;
    const int64_t bytes = program_.storages[s].bytes;
    if (state_[s] == StorageState::kOffloading) {
      allocator_->Free(s);
      releasing_ -= bytes;
      SetState(s, StorageState::kOffloaded);
    } else if (host_copy_[s] == HostCopy::kCopying) {
      host_copy_[s] = HostCopy::kLanded;
    } else if (state_[s] == StorageState::kReloading) {
      --reloads_in_flight_;
      host_used_ -= bytes;  // the host copy is dropped once back
      SetState(s, StorageState::kResident);
    }
  }
}

void Engine::StallUntil(int64_t t) {
  if (t > now_) {
    result_.stall_ns += t - now_;
    now_ = t;
  }
  Advance(now_);
}

bool Engine::Allocate(int64_t id, int64_t bytes) {
  for (;;) {
    Advance(now_);
    if (allocator_->Allocate(id, bytes)) {
      result_.peak_bytes =
          std::max(result_.peak_bytes, allocator_->footprint());
      return true;
    }
    // What offloads in flight will not cover is what the policy must free.
    const int64_t headroom = allocator_->capacity() - allocator_->used();
    int64_t shortfall = bytes - headroom - releasing_;
    if (shortfall <= 0 && !d2h_.queue.empty()) {
      // Enough is on its way out: wait for the next copy to land.
      StallUntil(d2h_.queue.front().end_ns);
      continue;
    }
    if (shortfall <= 0) shortfall = bytes;  // fragmentation: ask for more
    const int64_t before = allocator_->used() - releasing_;
    if (policy_.MakeRoom(*this, shortfall) &&
        allocator_->used() - releasing_ < before) {
      continue;
    }
    if (!d2h_.queue.empty()) {
      StallUntil(d2h_.queue.front().end_ns);
      continue;
    }
    const bool fragmented =
        allocator_->capacity() - allocator_->used() >= bytes;
    if (fragmented && policy_.FreesRanges() && FreeRangeFor(bytes)) continue;
    Fail(absl::StrCat(
        "out of memory at step ", step_, ": needs ", bytes, " bytes, ",
        allocator_->used(), " of ", allocator_->capacity(),
        " in use and the policy can release no more",
        fragmented ? " (fragmentation: enough bytes are free, but not in "
                     "one piece the allocator can use, and the blocks "
                     "that cannot be released now (in use by the step, or "
                     "needing host room the pool lacks) split every range "
                     "that could hold it)"
                   : ""));
    return false;
  }
}

void Engine::CancelReload(int32_t s) {
  // The copy's link time is spent; its end is ignored (generation), and
  // the host copy, kept until a reload lands, is the storage again.
  ++generation_[s];
  --reloads_in_flight_;
  allocator_->Free(s);
  SetState(s, StorageState::kOffloaded);
}

bool Engine::FreeRangeFor(int64_t bytes) {
  // The policy released what it would, and the bytes free are enough but
  // lie in pieces: a memory manager under any policy frees the blocks of
  // the cheapest range that would hold the allocation, as it can (evicting
  // what can be rebuilt, offloading the rest).
  const int64_t host = host_free();
  const std::vector<int64_t> ids =
      allocator_->BlocksToFreeForRange(bytes, [&](int64_t id) {
        if (id < 0) return false;  // a workspace
        const auto s = static_cast<int32_t>(id);
        if (locks_[s] > 0) return false;
        // A prefetch still copying in goes back to its host copy.
        if (state_[s] == StorageState::kReloading) return true;
        return CanEvict(s) || (state_[s] == StorageState::kResident &&
                               program_.storages[s].bytes <= host);
      });
  bool any = false;
  for (int64_t id : ids) {
    const auto s = static_cast<int32_t>(id);
    if (state_[s] == StorageState::kReloading) {
      CancelReload(s);
      any = true;
      continue;
    }
    any = (CanEvict(s) ? Evict(s) : Offload(s)) || any;
  }
  if (any) ++result_.range_releases;
  return any;
}

bool Engine::Materialize(int32_t s, int depth) {
  switch (state_[s]) {
    case StorageState::kResident:
      return true;
    case StorageState::kOffloading:
      // Still on the device: keep it and drop the copy.
      ++generation_[s];
      releasing_ -= program_.storages[s].bytes;
      host_used_ -= program_.storages[s].bytes;
      SetState(s, StorageState::kResident);
      return true;
    case StorageState::kReloading: {
      int64_t end = now_;
      for (const auto& tr : h2d_->queue) {
        if (tr.storage == s && tr.generation == generation_[s]) end = tr.end_ns;
      }
      StallUntil(end);
      if (state_[s] == StorageState::kResident) return true;
      Fail(absl::StrCat("reload of ", program_.storages[s].name, " was lost"));
      return false;
    }
    case StorageState::kOffloaded: {
      if (program_.Recomputable(s) &&
          policy_.ChooseRestore(*this, s) == Restore::kRecompute) {
        host_used_ -= program_.storages[s].bytes;
        return Recompute(s, depth);
      }
      const int64_t bytes = program_.storages[s].bytes;
      Lock(s);  // not a release candidate while room is made for it
      const bool ok = Allocate(s, bytes);
      Unlock(s);
      if (!ok) return false;
      const int64_t start = std::max(now_, h2d_->free_at);
      h2d_->free_at = start + CopyNs(bytes, device_.h2d_bytes_per_s);
      ++generation_[s];
      host_used_ -= bytes;
      result_.h2d_bytes += bytes;
      ++result_.reloads;
      SetState(s, StorageState::kReloading);
      StallUntil(h2d_->free_at);
      SetState(s, StorageState::kResident);
      return true;
    }
    case StorageState::kEvicted:
      return Recompute(s, depth);
    case StorageState::kDead:
      // Rebuilt for a child only; Recompute drops it again right after.
      return Recompute(s, depth);
    case StorageState::kAbsent:
      break;
  }
  Fail(absl::StrCat("storage ", program_.storages[s].name,
                    " is read before it exists"));
  return false;
}

bool Engine::Recompute(int32_t s, int depth) {
  const Storage& st = program_.storages[s];
  if (st.producer < 0 || !program_.Recomputable(s) || depth > 100000) {
    Fail(absl::StrCat("cannot rebuild ", st.name,
                      ": it was released and has no recompute path"));
    return false;
  }
  const Step& producer = program_.steps[st.producer];
  std::vector<int32_t> held;
  std::vector<int32_t> rebuilt_dead;  // freed ancestors rebuilt for `s`
  bool ok = true;
  for (int32_t p : st.parents) {
    const bool was_dead = state_[p] == StorageState::kDead;
    if (!Materialize(p, depth + 1)) {
      ok = false;
      break;
    }
    Lock(p);
    held.push_back(p);
    if (was_dead) rebuilt_dead.push_back(p);
  }
  Lock(s);
  ok = ok && Allocate(s, st.bytes) &&
       (producer.workspace_bytes == 0 ||
        Allocate(kWorkspaceId - 1 - depth, producer.workspace_bytes));
  Unlock(s);
  if (ok) {
    now_ += producer.time_ns;
    result_.recompute_ns += producer.time_ns;
    ++result_.recomputes;
    if (producer.workspace_bytes > 0)
      allocator_->Free(kWorkspaceId - 1 - depth);
    SetState(s, StorageState::kResident);
    Advance(now_);
  }
  for (int32_t p : held) Unlock(p);
  // The framework had dropped them: they were needed for `s` alone.
  for (int32_t p : rebuilt_dead) {
    if (locks_[p] == 0 && state_[p] != StorageState::kDead) FreeStorage(p);
  }
  return ok;
}

void Engine::FreeStorage(int32_t s) {
  const int64_t bytes = program_.storages[s].bytes;
  switch (state_[s]) {
    case StorageState::kResident:
      DropHostCopy(s);
      allocator_->Free(s);
      break;
    case StorageState::kOffloading:
      allocator_->Free(s);
      releasing_ -= bytes;
      host_used_ -= bytes;
      break;
    case StorageState::kReloading:
      allocator_->Free(s);
      host_used_ -= bytes;
      --reloads_in_flight_;
      break;
    case StorageState::kOffloaded:
      host_used_ -= bytes;
      break;
    default:
      break;
  }
  ++generation_[s];  // cancels a transfer in flight
  SetState(s, StorageState::kDead);
}

bool Engine::TakeOverInPlace(const Step& step, int32_t created) {
  for (const InPlace& ip : step.in_place) {
    if (ip.created != created || state_[ip.old] != StorageState::kResident ||
        std::find(step.frees.begin(), step.frees.end(), ip.old) ==
            step.frees.end()) {
      continue;
    }
    allocator_->Free(ip.old);
    if (!allocator_->Allocate(created, program_.storages[created].bytes)) {
      // Only a rounding allocator could refuse; give the block back.
      (void)allocator_->Allocate(ip.old, program_.storages[ip.old].bytes);
      return false;
    }
    DropHostCopy(ip.old);
    ++generation_[ip.old];
    SetState(ip.old, StorageState::kDead);
    return true;
  }
  return false;
}

bool Engine::RunIteration() {
  policy_.BeginIteration(*this);
  step_ = 0;
  for (int32_t s = 0; s < static_cast<int32_t>(program_.storages.size()); ++s) {
    if (program_.storages[s].constant) {
      // Parameters keep their place across iterations; inputs that the last
      // iteration dropped come anew.
      const StorageState st = state_[s];
      if (st != StorageState::kAbsent && st != StorageState::kDead) continue;
      if (!Allocate(s, program_.storages[s].bytes)) return false;
      SetState(s, StorageState::kResident);
      policy_.OnCreate(*this, s);
    } else if (state_[s] != StorageState::kAbsent) {
      if (state_[s] != StorageState::kDead) FreeStorage(s);
      state_[s] = StorageState::kAbsent;
    }
  }
  for (int32_t s : program_.initial_frees) FreeStorage(s);
  int64_t op_time_done = 0;  // of this iteration's steps so far
  for (step_ = 0; step_ < static_cast<int32_t>(program_.steps.size());
       ++step_) {
    const Step& step = program_.steps[step_];
    Advance(now_);
    policy_.BeforeStep(*this, step_);
    for (int32_t s : step.reads) {
      if (!Materialize(s, 0)) return false;
      Lock(s);
    }
    for (int32_t s : step.creates) {
      Lock(s);
      if (!TakeOverInPlace(step, s) &&
          !Allocate(s, program_.storages[s].bytes)) {
        return false;
      }
      SetState(s, StorageState::kResident);
      policy_.OnCreate(*this, s);
    }
    if (step.workspace_bytes > 0 &&
        !Allocate(kWorkspaceId, step.workspace_bytes)) {
      return false;
    }
    now_ += step.time_ns;
    op_time_done += step.time_ns;
    if (step.workspace_bytes > 0) allocator_->Free(kWorkspaceId);
    for (int32_t s : step.reads) {
      policy_.OnAccess(*this, s);
      Unlock(s);
    }
    for (int32_t s : step.creates) {
      policy_.OnAccess(*this, s);
      Unlock(s);
    }
    for (int32_t s : step.frees) FreeStorage(s);
    Advance(now_);
    policy_.AfterStep(*this, step_);
    // Every step to come takes at least its op time: a run whose clock
    // and the op time still to come reach the limit cannot end before it.
    if (options_.give_up_at_ns > 0 &&
        step_ + 1 < static_cast<int32_t>(program_.steps.size()) &&
        now_ + (program_.compute_ns - op_time_done) +
                (options_.iterations - 1 - iteration_) * program_.compute_ns >=
            options_.give_up_at_ns) {
      gave_up_ = true;
      Fail(absl::StrCat("gave up at ", now_, " ns (give_up_at_ns)"));
      return false;
    }
  }
  return true;
}

SimResult Engine::Run() {
  result_.policy = policy_.name();
  result_.budget_bytes = options_.budget_bytes;
  result_.min_budget_bytes = program_.min_budget_bytes;
  result_.compute_ns = program_.compute_ns;
  for (iteration_ = 0; iteration_ < options_.iterations; ++iteration_) {
    const bool measured = iteration_ + 1 == options_.iterations;
    if (measured) {
      // Only the last iteration counts; transfers still in flight carry on.
      const SimResult keep = result_;
      result_ = SimResult{};
      result_.policy = keep.policy;
      result_.budget_bytes = keep.budget_bytes;
      result_.min_budget_bytes = keep.min_budget_bytes;
      result_.compute_ns = keep.compute_ns;
      result_.peak_bytes = allocator_->footprint();
    }
    const int64_t start = now_;
    if (!RunIteration()) {
      result_.fits = false;
      result_.gave_up = gave_up_;
      result_.failure = failure_;
      result_.planning_ns = policy_.planning_ns();
      return result_;
    }
    result_.makespan_ns = now_ - start;
  }
  result_.fits = true;
  result_.total_makespan_ns = now_;  // the clock starts at 0
  result_.iterations = options_.iterations;
  result_.planning_ns = policy_.planning_ns();
  return result_;
}

}  // namespace

absl::StatusOr<SimResult> Simulate(const Program& program,
                                   const DeviceProfile& device,
                                   SimPolicy& policy,
                                   const SimOptions& options) {
  if (options.budget_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget must be positive, got ", options.budget_bytes, " bytes"));
  }
  if (options.iterations < 1) {
    return absl::InvalidArgumentError("iterations must be at least 1");
  }
  if (device.h2d_bytes_per_s <= 0 || device.d2h_bytes_per_s <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device.name, " has no host-link bandwidth"));
  }
  if (options.budget_bytes < program.min_budget_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("infeasible: needs at least ", program.min_budget_bytes,
                     " bytes (step ", program.min_budget_step,
                     " alone), budget is ", options.budget_bytes));
  }
  Engine engine(program, device, policy, options);
  absl::StatusOr<SimResult> result = engine.Run();
  if (!result.ok()) return result;
  if (absl::Status s = policy.Consistency(); !s.ok()) {
    return absl::InternalError(
        absl::StrCat("policy '", policy.name(),
                     "' reported an inconsistent state: ", s.message()));
  }
  return result;
}

absl::StatusOr<int64_t> UnlimitedPeak(const Program& program,
                                      const DeviceProfile& device,
                                      AllocatorKind allocator, int iterations) {
  // Releases nothing: the budget only has to hold everything.
  class KeepAll final : public SimPolicy {
   public:
    std::string name() const override { return "none"; }
    bool MakeRoom(SimContext&, int64_t) override { return false; }
    bool FreesRanges() const override { return false; }
  } keep_all;
  SimOptions o;
  o.budget_bytes = int64_t{1} << 50;
  o.allocator = allocator;
  // A run's peak is its last iteration's: the largest over the runs of 1
  // to `iterations` iterations is the whole run's.
  int64_t peak = 0;
  for (o.iterations = 1; o.iterations <= std::max(1, iterations);
       ++o.iterations) {
    absl::StatusOr<SimResult> r = Simulate(program, device, keep_all, o);
    if (!r.ok()) return r.status();
    if (!r->fits) {
      return absl::InternalError(
          absl::StrCat(program.name, " does not fit in 1 PiB: ", r->failure));
    }
    peak = std::max(peak, r->peak_bytes);
  }
  return peak;
}

}  // namespace deltad::sim
