#include "policies/sim/dynamic_policy.h"

#include <algorithm>
#include <utility>

namespace deltad::sim {

namespace {

constexpr policy::SessionId kSession = 1;

policy::Watermarks MakeWatermarks(double high, double low) {
  auto w = policy::Watermarks::Create(high, low);
  return w.ok() ? *w : *policy::Watermarks::Create();
}

// What a copy costs beside its bytes, measured on an H200 (gpu_bench,
// docs/BENCHMARKS.md, 2026-11-30): bare cudaMemcpyAsync of 1 MiB took
// 27.0 us (D2H) and 27.4 us (H2D), against 19.0 and 18.9 us at the
// bandwidth of 256 MiB copies.
constexpr int64_t kCopyLatencyNs = 8000;

}  // namespace

DynamicPolicy::DynamicPolicy(DynamicPolicyOptions options)
    : options_(std::move(options)),
      filter_(options_.filter, &costs_),
      director_(costs_, {.restore_may_recompute = options_.director_restore}),
      watermarks_(
          MakeWatermarks(options_.high_watermark, options_.low_watermark)) {
  costs_.SetPriceOffloadedAncestors(options_.price_offloaded_ancestors,
                                    options_.director_restore);
  policy::PrefetchOptions p;
  p.max_in_flight = std::max(1, options_.max_prefetch_in_flight);
  auto prefetcher = policy::Prefetcher::Create(p);
  if (prefetcher.ok()) prefetcher_.emplace(std::move(*prefetcher));
}

policy::TensorId DynamicPolicy::IdOf(int32_t s) const {
  return static_cast<size_t>(s) < ids_.size() ? ids_[s] : 0;
}

void DynamicPolicy::Check(const absl::Status& status) {
  if (!status.ok() && mirror_status_.ok()) mirror_status_ = status;
}

void DynamicPolicy::BeginIteration(SimContext& ctx) {
  if (ids_.empty()) {
    ids_.assign(ctx.program().storages.size(), 0);
    // The simulated device's link, as the daemon would measure it, and a
    // copy's cost beyond its bytes as measured on a GPU (the simulated link
    // itself carries copies at its bandwidth alone).
    (void)costs_.SetBandwidth(
        0, {ctx.device().d2h_bytes_per_s, ctx.device().h2d_bytes_per_s,
            kCopyLatencyNs});
  }
  if (!first_iteration_ && options_.replay_window_fraction > 0) {
    plan_.EndIteration();
  }
  first_iteration_ = false;
  to_copy_.clear();  // the iteration's storages start anew
  copying_.clear();
}

void DynamicPolicy::SeedAccessOrder(const Program& program,
                                    const std::vector<int32_t>& accesses) {
  for (int32_t s : accesses) {
    plan_.Record(static_cast<uint64_t>(s) + 1, program.storages[s].bytes);
  }
  plan_.EndIteration();
}

void DynamicPolicy::ReplayAccessOrder(const Program& program,
                                      const std::vector<int32_t>& accesses,
                                      double window_fraction) {
  options_.replay_window_fraction = window_fraction;
  plan_ = policy::AccessPlan();
  SeedAccessOrder(program, accesses);
}

void DynamicPolicy::OnCreate(SimContext& ctx, int32_t s) {
  const Program& program = ctx.program();
  const Storage& st = program.storages[s];
  // One spec reused: its parents' vector allocates once, not per tensor.
  policy::TensorSpec& spec = spec_;
  spec.parents.clear();
  spec.id = next_id_++;
  spec.session = kSession;
  spec.gpu = 0;
  // The table refuses empty tensors; an empty storage weighs one byte.
  spec.bytes = std::max<int64_t>(1, st.bytes);
  spec.compute_cost_ns =
      st.producer >= 0 ? program.steps[st.producer].time_ns : 0;
  spec.stable_key = static_cast<uint64_t>(s) + 1;
  spec.flags.uncomputable = !program.Recomputable(s);
  spec.flags.evict_pinned = !options_.allow_evict;
  spec.flags.offload_pinned = !options_.allow_offload;
  for (int32_t p : st.parents) {
    if (ids_[p] != 0 && table_.Contains(ids_[p]))
      spec.parents.push_back(ids_[p]);
  }
  const absl::Status added = table_.Add(spec, ctx.now_ns());
  Check(added);
  if (added.ok()) ids_[s] = spec.id;
  if (options_.copy_ahead && options_.allow_offload &&
      program.steps[ctx.step()].phase == Phase::kForward) {
    to_copy_.push_back(s);
  }
}

void DynamicPolicy::OnHostCopyDropped(SimContext& /*ctx*/, int32_t s) {
  const policy::TensorId id = IdOf(s);
  const policy::Tensor* t = id == 0 ? nullptr : table_.Find(id);
  // One the planner has in hand (releasing) keeps what it was priced at:
  // the engine's release carries the copy out again.
  if (t != nullptr && t->state == policy::TensorState::kResident &&
      t->flags.host_copy) {
    Check(table_.SetHostCopy(id, false));
  }
}

void DynamicPolicy::OnAccess(SimContext& ctx, int32_t s) {
  const policy::TensorId id = IdOf(s);
  if (id != 0) Check(table_.Touch(id, ctx.now_ns()));
  if (options_.replay_window_fraction > 0) {
    plan_.Record(static_cast<uint64_t>(s) + 1, ctx.program().storages[s].bytes);
  }
}

void DynamicPolicy::OnStateChange(SimContext& ctx, int32_t s, StorageState from,
                                  StorageState to) {
  using TS = policy::TensorState;
  const policy::TensorId id = IdOf(s);
  // Dead storages rebuilt for a child are not the framework's tensors.
  if (id == 0 || from == StorageState::kDead) return;
  const policy::Tensor* t = table_.Find(id);
  if (t == nullptr) return;
  const TS cur = t->state;
  switch (to) {
    case StorageState::kDead:
      Check(table_.Free(id));
      ids_[s] = 0;
      return;
    case StorageState::kResident:
      if (cur == TS::kOffloading) {
        Check(table_.CancelRelease(id));
      } else if (cur == TS::kReloading) {
        Check(table_.SetState(id, TS::kResident));
        // Its host bytes kept (SimOptions::keep_reloaded_copies): releasing
        // it again is an offload with no copy.
        if (ctx.host_copy(s) == HostCopy::kLanded) {
          Check(table_.SetHostCopy(id, true));
        }
      } else if (cur == TS::kEvicted || cur == TS::kOffloaded) {
        Check(table_.MarkRecomputed(id, ctx.now_ns()));
      }
      return;
    case StorageState::kOffloading:
      if (cur != TS::kOffloading) Check(table_.SetState(id, TS::kOffloading));
      return;
    case StorageState::kOffloaded:
      if (cur != TS::kOffloaded) Check(table_.SetState(id, TS::kOffloaded));
      if (prefetcher_) prefetcher_->OnOffloaded(id);
      return;
    case StorageState::kReloading:
      if (cur != TS::kReloading) Check(table_.SetState(id, TS::kReloading));
      return;
    case StorageState::kEvicted:
      if (cur != TS::kEvicted) Check(table_.SetState(id, TS::kEvicted));
      return;
    case StorageState::kAbsent:
      return;
  }
}

std::vector<policy::TensorId> DynamicPolicy::LockInUse(SimContext& ctx) {
  // Every decision prices offloads behind the copies already queued, and
  // those of tensors whose copy has landed at no copy at all.
  MarkLandedCopies(ctx);
  costs_.SetOffloadBacklog(0, ctx.releasing_bytes());
  // The engine's locks (the op running, a recompute's inputs) become table
  // locks for the planner, so it never picks a tensor in use.
  std::vector<policy::TensorId> locked;
  for (int32_t s : ctx.locked_storages()) {
    const policy::TensorId id = IdOf(s);
    if (id != 0 && table_.Lock(id).ok()) locked.push_back(id);
  }
  return locked;
}

bool DynamicPolicy::Release(SimContext& ctx, int64_t bytes) {
  std::vector<policy::TensorId> locked = LockInUse(ctx);
  policy::ReleasePlanner planner(table_, filter_, director_);
  // Replaying an iteration seen, the picks know when each tensor is used
  // next rather than guess it from when it was used last.
  if (options_.replay_window_fraction > 0 && plan_.has_plan()) {
    planner.SetNextUse([this](const policy::Tensor& t) {
      return plan_.AccessesUntilNext(t.stable_key);
    });
  }
  policy::Scope scope;
  scope.gpu = 0;
  auto orders = planner.Release(scope, bytes, ctx.now_ns(), ctx.host_free());
  for (policy::TensorId id : locked) Check(table_.Unlock(id));
  if (!orders.ok()) return false;
  bool any = false;
  for (const policy::ReleaseOrder& o : *orders) {
    const int32_t s = static_cast<int32_t>(table_.Find(o.id)->stable_key - 1);
    const bool done = o.action == policy::ReleaseAction::kEvict
                          ? ctx.Evict(s)
                          : ctx.Offload(s);
    if (done) {
      any = true;
    } else {
      Check(table_.CancelRelease(o.id));
      // Refused (in use): a copy made ahead is still there.
      if (ctx.host_copy(s) == HostCopy::kLanded) {
        Check(table_.SetHostCopy(o.id, true));
      }
    }
  }
  return any;
}

void DynamicPolicy::OffloadAhead(SimContext& ctx, int64_t bytes) {
  std::vector<policy::TensorId> locked = LockInUse(ctx);
  policy::ReleasePlanner planner(table_, filter_, director_);
  policy::Scope scope;
  scope.gpu = 0;
  const std::vector<policy::ReleaseOrder> orders =
      planner.OffloadAhead(scope, bytes, ctx.now_ns(), ctx.host_free());
  for (policy::TensorId id : locked) Check(table_.Unlock(id));
  for (const policy::ReleaseOrder& o : orders) {
    if (!ctx.Offload(static_cast<int32_t>(table_.Find(o.id)->stable_key - 1))) {
      Check(table_.CancelRelease(o.id));
    }
  }
}

void DynamicPolicy::CopyAhead(SimContext& ctx, int32_t step) {
  // Copies start while the link would be idle before the next step ends
  // (this step's time standing for the next one's): one behind the other,
  // so a release that comes waits for at most the copy in flight.
  const int64_t horizon = ctx.now_ns() + ctx.program().steps[step].time_ns;
  while (!to_copy_.empty() && ctx.d2h_free_at() <= horizon) {
    const int32_t s = to_copy_.front();
    // The oldest first: a forward pass reads them last in the backward.
    // Those gone by now were temporaries; the link never carried them.
    if (ctx.state(s) != StorageState::kResident ||
        ctx.host_copy(s) != HostCopy::kNone) {
      to_copy_.pop_front();
      continue;
    }
    if (!ctx.CopyAhead(s)) return;  // no host room
    to_copy_.pop_front();
    copying_.push_back(s);
  }
}

void DynamicPolicy::MarkLandedCopies(SimContext& ctx) {
  // The link carries copies in the order issued: they land in that order.
  while (!copying_.empty()) {
    const int32_t s = copying_.front();
    const HostCopy copy = ctx.host_copy(s);
    if (copy == HostCopy::kCopying) return;
    copying_.pop_front();
    const policy::TensorId id = IdOf(s);
    if (copy == HostCopy::kLanded && id != 0) {
      Check(table_.SetHostCopy(id, true));
    }
  }
}

bool DynamicPolicy::MakeRoom(SimContext& ctx, int64_t bytes) {
  if (Release(ctx, bytes)) return true;
  // Less than asked may still be releasable: take what there is, one tensor
  // at a time, and let the simulator decide whether that is enough.
  bool any = false;
  for (int64_t freed = 0; freed < bytes;) {
    const int64_t before = ctx.device_used() - ctx.releasing_bytes();
    if (!Release(ctx, 1)) break;
    any = true;
    freed += before - (ctx.device_used() - ctx.releasing_bytes());
  }
  return any;
}

void DynamicPolicy::AfterStep(SimContext& ctx, int32_t step) {
  const Phase phase = ctx.program().steps[step].phase;
  if (options_.copy_ahead && phase == Phase::kForward) CopyAhead(ctx, step);
  const int64_t committed = ctx.device_used() - ctx.releasing_bytes();
  if (options_.early_release != EarlyRelease::kNone &&
      phase == Phase::kForward) {
    auto bytes = watermarks_.BytesToFree(committed, 0, ctx.budget());
    if (bytes.ok() && *bytes > 0) {
      if (options_.early_release == EarlyRelease::kOffloadAhead) {
        OffloadAhead(ctx, *bytes);
      } else {
        MakeRoom(ctx, *bytes);
      }
    }
  }
  if (options_.prefetch && prefetcher_ && phase == Phase::kBackward) {
    // Fill up to the high watermark, not beyond: past it the policy would
    // start releasing again (DELTA §4.2: reloading too much costs more).
    const int64_t room =
        static_cast<int64_t>(watermarks_.high() *
                             static_cast<double>(ctx.budget())) -
        ctx.device_used();
    if (room <= 0) return;
    const bool replay = options_.replay_window_fraction > 0 && plan_.has_plan();
    if (replay) {
      policy::PrefetchOptions p;
      p.max_in_flight = std::max(1, options_.max_prefetch_in_flight);
      p.window_bytes = static_cast<int64_t>(options_.replay_window_fraction *
                                            static_cast<double>(ctx.budget()));
      auto replayer = policy::Prefetcher::Create(p);
      if (!replayer.ok()) return;
      for (policy::TensorId id : replayer->Plan(
               table_, room, ctx.reloads_in_flight(), &plan_, kSession)) {
        ctx.Prefetch(static_cast<int32_t>(table_.Find(id)->stable_key - 1));
      }
      return;
    }
    for (policy::TensorId id : prefetcher_->Plan(
             table_, room, ctx.reloads_in_flight(), nullptr, kSession)) {
      ctx.Prefetch(static_cast<int32_t>(table_.Find(id)->stable_key - 1));
    }
  }
}

Restore DynamicPolicy::ChooseRestore(SimContext& /*ctx*/, int32_t s,
                                     int64_t reload_ns) {
  const policy::TensorId id = IdOf(s);
  if (!options_.director_restore || id == 0) return Restore::kReload;
  return director_.ChooseRestore(table_, table_.SlotOf(id), reload_ns) ==
                 policy::RestoreAction::kRecompute
             ? Restore::kRecompute
             : Restore::kReload;
}

std::optional<DynamicPolicyOptions> DynamicPolicyPreset(
    const std::string& name) {
  DynamicPolicyOptions o;
  o.name = name;
  if (name == "delta" || name == "delta-replay" || name == "delta-ahead" ||
      name == "delta-nocopy" || name == "delta-sampled") {
    // The project's configuration: the cost-aware Filter, releases when
    // memory is short, copies ahead while the link is idle, prefetch in
    // backward. docs/BENCHMARKS.md shows why it differs from the paper.
    // Ablations (not in the default table): delta-nocopy copies nothing
    // ahead; delta-ahead offloads ahead from the high watermark instead;
    // delta-sampled searches a sample, small tensors aside, as the daemon
    // does past exact_search_below candidates.
    o.filter.heuristic = policy::Heuristic::kDeltaCost;
    o.filter.sampled = o.filter.skip_small = name == "delta-sampled";
    o.copy_ahead =
        name == "delta" || name == "delta-replay" || name == "delta-sampled";
    if (name == "delta-replay") o.replay_window_fraction = 0.25;
    if (name == "delta-ahead") o.early_release = EarlyRelease::kOffloadAhead;
    return o;
  }
  if (name == "delta-paper") {
    // DELTA as published: 1/(m*s), and Algorithm 1 releasing (evict or
    // offload) from 3/4 of the budget down to the low watermark.
    o.filter.heuristic = policy::Heuristic::kDelta;
    o.early_release = EarlyRelease::kRelease;
    return o;
  }
  if (name == "dtr" || name == "dtr-sampled") {
    o.filter.heuristic = policy::Heuristic::kDtr;
    o.filter.sampled = name == "dtr-sampled";
    o.filter.skip_small = name == "dtr-sampled";
    o.allow_offload = false;
    o.prefetch = false;
    return o;
  }
  if (name == "swap-lru") {
    o.filter.heuristic = policy::Heuristic::kLru;
    o.allow_evict = false;
    o.prefetch = false;
    o.director_restore = false;
    return o;
  }
  return std::nullopt;
}

}  // namespace deltad::sim
