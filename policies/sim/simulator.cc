#include "policies/sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "policies/sim/engine.h"

namespace deltad::sim {

namespace engine_internal {

bool Engine::Materialize(int32_t s, int depth) {
  switch (state_[s]) {
    case StorageState::kResident:
      return true;
    case StorageState::kOffloading:
      // Still on the device: keep it and drop the copy.
      CancelOffload(s);
      return true;
    case StorageState::kReloading: {
      int64_t end = now_;
      for (const auto& tr : h2d_->queue) {
        if (tr.storage == s && tr.generation == generation_[s]) end = tr.end_ns;
      }
      // A prefetch that lands too late: rebuilding may be sooner than
      // waiting for it (its link time is spent either way; its memory is
      // freed at once, as FreeRangeFor frees a prefetch's, where a memory
      // manager would keep it until the copy lands).
      if (end > now_ && program_.Recomputable(s) &&
          policy_.ChooseRestore(*this, s, end - now_) == Restore::kRecompute) {
        CancelReload(s);
        host_used_ -= program_.storages[s].bytes;
        return Recompute(s, depth);
      }
      StallUntil(end);
      if (state_[s] == StorageState::kResident) return true;
      Fail(absl::StrCat("reload of ", program_.storages[s].name, " was lost"));
      return false;
    }
    case StorageState::kOffloaded: {
      if (program_.Recomputable(s) &&
          policy_.ChooseRestore(*this, s, -1) == Restore::kRecompute) {
        host_used_ -= program_.storages[s].bytes;
        return Recompute(s, depth);
      }
      const int64_t bytes = program_.storages[s].bytes;
      Lock(s);  // not a release candidate while room is made for it
      const bool ok = Allocate(s, bytes);
      Unlock(s);
      if (!ok) return false;
      // An empty storage has nothing to copy: it waits for no transfer
      // queued on the link.
      int64_t end = now_;
      if (bytes > 0) {
        end = std::max(now_, h2d_->free_at) +
              CopyNs(bytes, device_.h2d_bytes_per_s);
        h2d_->free_at = end;
      }
      ++generation_[s];
      result_.h2d_bytes += bytes;
      ++result_.reloads;
      SetState(s, StorageState::kReloading);
      StallUntil(end);
      KeepReloadedCopy(s);
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

int32_t Engine::TakeOverInPlace(const Step& step, int32_t created) {
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
      return -1;
    }
    ++generation_[ip.old];
    return ip.old;
  }
  return -1;
}

bool Engine::CarryOver(const Carry& c) {
  const int32_t from = c.final;
  const int32_t to = c.constant;
  // A copy under way ends where it started: an offload not landed leaves
  // the version on the device, a reload not landed on the host.
  switch (state_[from]) {
    case StorageState::kAbsent:  // the first iteration
      return true;
    case StorageState::kOffloading:
      CancelOffload(from);
      break;
    case StorageState::kReloading:
      CancelReload(from);
      break;
    default:
      break;
  }
  const StorageState where = state_[from];
  const int64_t bytes = program_.storages[from].bytes;
  if (where != StorageState::kResident && where != StorageState::kOffloaded) {
    Fail(absl::StrCat("the last version of ", program_.storages[to].name,
                      " was lost: it cannot start the next iteration"));
    return false;
  }
  // The version's memory becomes the constant's: freed, then taken again
  // at once, so the two are never held together.
  FreeStorage(from);
  state_[from] = StorageState::kAbsent;
  if (where == StorageState::kResident) {
    if (!Allocate(to, bytes)) return false;
    SetState(to, StorageState::kResident);
    policy_.OnCreate(*this, to);
    return true;
  }
  // On the host: the policy sees it made and offloaded, and the next
  // iteration reloads it as any offloaded storage, where a reload pays.
  host_used_ += bytes;
  SetState(to, StorageState::kResident);
  policy_.OnCreate(*this, to);
  SetState(to, StorageState::kOffloading);
  SetState(to, StorageState::kOffloaded);
  return true;
}

bool Engine::RunIteration() {
  policy_.BeginIteration(*this);
  step_ = 0;
  for (const Carry& c : program_.carries) {
    if (!CarryOver(c)) return false;
  }
  // What the last iteration left and this one does not start from goes
  // first, so that it is never held beside what comes anew.
  const auto storages = static_cast<int32_t>(program_.storages.size());
  for (int32_t s = 0; s < storages; ++s) {
    if (program_.storages[s].constant || state_[s] == StorageState::kAbsent) {
      continue;
    }
    if (state_[s] != StorageState::kDead) FreeStorage(s);
    state_[s] = StorageState::kAbsent;
  }
  // Parameters keep their place across iterations; inputs that the last
  // iteration dropped come anew.
  for (int32_t s = 0; s < storages; ++s) {
    const StorageState st = state_[s];
    if (!program_.storages[s].constant ||
        (st != StorageState::kAbsent && st != StorageState::kDead)) {
      continue;
    }
    if (!Allocate(s, program_.storages[s].bytes)) return false;
    SetState(s, StorageState::kResident);
    policy_.OnCreate(*this, s);
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
      const int32_t replaced = TakeOverInPlace(step, s);
      if (replaced < 0 && !Allocate(s, program_.storages[s].bytes)) {
        return false;
      }
      SetState(s, StorageState::kResident);
      policy_.OnCreate(*this, s);
      // After the result is created from it: a policy that tracks parents
      // keeps the replaced storage as the ancestor a rebuild needs.
      if (replaced >= 0) {
        DropHostCopy(replaced);  // one the policy started meanwhile too
        SetState(replaced, StorageState::kDead);
      }
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
    // Every step to come takes at least its op time: a measured iteration
    // whose time so far and the op time still to come reach the limit
    // cannot end before it.
    const int64_t give_up_at_ns =
        options_.shared_give_up_at_ns != nullptr
            ? options_.shared_give_up_at_ns->load(std::memory_order_relaxed)
            : options_.give_up_at_ns;
    if (give_up_at_ns > 0 && iteration_ + 1 == options_.iterations &&
        step_ + 1 < static_cast<int32_t>(program_.steps.size()) &&
        now_ - iteration_start_ + (program_.compute_ns - op_time_done) >=
            give_up_at_ns) {
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
    iteration_start_ = now_;
    if (!RunIteration()) {
      result_.fits = false;
      result_.gave_up = gave_up_;
      result_.failure = failure_;
      result_.planning_ns = policy_.planning_ns();
      result_.planning_cpu_ns = policy_.planning_cpu_ns();
      return result_;
    }
    result_.makespan_ns = now_ - iteration_start_;
  }
  result_.fits = true;
  result_.total_makespan_ns = now_;  // the clock starts at 0
  result_.iterations = options_.iterations;
  result_.planning_ns = policy_.planning_ns();
  result_.planning_cpu_ns = policy_.planning_cpu_ns();
  return result_;
}

}  // namespace engine_internal

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
  engine_internal::Engine engine(program, device, policy, options);
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
