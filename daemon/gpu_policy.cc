#include "daemon/gpu_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "policies/status_macros.h"

namespace deltad::daemon {

namespace {
constexpr int64_t kMaxComputeCostNs = 1'000'000'000'000;
constexpr int kMaxParents = 4096;
}  // namespace

using policy::Tensor;
using policy::TensorId;
using policy::TensorState;

namespace {

std::string KindName(int kind) {
  const std::string& name = v1::TensorEvent::Kind_Name(kind);
  return name.empty() ? absl::StrCat("kind ", kind) : name;
}

int64_t Fraction(double fraction, int64_t bytes) {
  return static_cast<int64_t>(
      std::floor(fraction * static_cast<double>(bytes)));
}

// Whether an error from the planner only says that no tensor qualified.
bool NothingToRelease(const absl::Status& s) {
  return absl::IsNotFound(s) || absl::IsResourceExhausted(s);
}

}  // namespace

// A batch checked against the table and against its own earlier entries:
// applying it cannot fail. The table is not copyable, so "all or nothing"
// is done by validating first and applying second, rather than applying to a
// copy. Each event becomes the table calls it stands for, chosen from the
// state the tensor will be in by then.
struct GpuPolicy::BatchPlan {
  enum class Op { kTouch, kFree, kSetState, kCancel, kRecompute };
  struct Step {
    Op op;
    TensorId id;
    TensorState to = TensorState::kResident;  // kSetState only
  };

  std::vector<policy::TensorSpec> specs;  // with GPU-wide ids
  std::vector<uint64_t> spec_locals;      // the session's id of each spec
  absl::flat_hash_map<uint64_t, size_t> created;  // own id -> index in specs
  std::vector<Step> steps;
  // EVICTED events that confirm an evict order: the table already shows
  // them, so they make no step, but the device memory was freed now.
  int64_t confirmed_evictions = 0;
  // What the batch adds to the session's committed device bytes.
  int64_t committed_delta = 0;
};

GpuPolicy::GpuPolicy(int gpu, int64_t gpu_budget_bytes,
                     GpuPolicyOptions options, policy::Watermarks watermarks)
    : gpu_(gpu),
      gpu_budget_bytes_(gpu_budget_bytes),
      options_(std::move(options)),
      watermarks_(watermarks),
      filter_(options_.filter, &costs_),
      director_(costs_) {}

absl::StatusOr<std::unique_ptr<GpuPolicy>> GpuPolicy::Create(
    int gpu, int64_t gpu_budget_bytes, GpuPolicyOptions options) {
  if (gpu < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative GPU index ", gpu));
  }
  if (gpu_budget_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU ", gpu, ": budget must be positive, got ", gpu_budget_bytes));
  }
  if (options.max_prefetch_in_flight < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_prefetch_in_flight must be at least 1, got ",
                     options.max_prefetch_in_flight));
  }
  // The compute-cost bound keeps cost sums from overflowing only up to this
  // many tensors in a session (see kMaxComputeCostNs).
  constexpr int64_t kMaxTensorsPerSession =
      std::numeric_limits<int64_t>::max() / 2 / kMaxComputeCostNs;
  if (options.max_tensors_per_session < 1 ||
      options.max_tensors_per_session > kMaxTensorsPerSession) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tensors_per_session must be within 1..", kMaxTensorsPerSession,
        ", got ", options.max_tensors_per_session));
  }
  if (options.max_batch_events < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_events must be at least 1, got ", options.max_batch_events));
  }
  absl::StatusOr<policy::Watermarks> watermarks =
      policy::Watermarks::Create(options.high_watermark, options.low_watermark);
  if (!watermarks.ok()) return watermarks.status();
  const policy::LinkBandwidth link = options.link;
  std::unique_ptr<GpuPolicy> p(
      new GpuPolicy(gpu, gpu_budget_bytes, std::move(options), *watermarks));
  DELTAD_RETURN_IF_ERROR(p->costs_.SetBandwidth(gpu, link));
  return p;
}

absl::Status GpuPolicy::AddSession(SessionId session, int64_t budget_bytes,
                                   int64_t host_quota_bytes) {
  if (sessions_.contains(session)) {
    return absl::AlreadyExistsError(
        absl::StrCat("session ", session, " is already on GPU ", gpu_));
  }
  if (budget_bytes < 0 || host_quota_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", session, ": negative budget (", budget_bytes,
                     " bytes) or host quota (", host_quota_bytes, " bytes)"));
  }
  policy::PrefetchOptions prefetch;
  prefetch.max_in_flight = options_.max_prefetch_in_flight;
  absl::StatusOr<policy::Prefetcher> prefetcher =
      policy::Prefetcher::Create(prefetch);
  if (!prefetcher.ok()) return prefetcher.status();
  Session& s = sessions_[session];
  s.budget_bytes = budget_bytes;
  s.host_quota_bytes = host_quota_bytes;
  s.prefetcher = std::make_unique<policy::Prefetcher>(std::move(*prefetcher));
  return absl::OkStatus();
}

absl::Status GpuPolicy::RemoveSession(SessionId session) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  table_.RemoveSession(session);
  sessions_.erase(it);
  return absl::OkStatus();
}

absl::Status GpuPolicy::SetBudget(SessionId session, int64_t budget_bytes) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  if (budget_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session ", session, ": negative budget ", budget_bytes, " bytes"));
  }
  it->second.budget_bytes = budget_bytes;
  return absl::OkStatus();
}

// --- Apply -----------------------------------------------------------------

absl::Status GpuPolicy::Apply(SessionId session, const v1::EventBatch& batch,
                              int64_t now_ns, AppliedCounts* counts) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  const int64_t entries =
      int64_t{batch.created_size()} + int64_t{batch.events_size()};
  if (entries > options_.max_batch_events) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "batch has ", batch.created_size(),
        " creations (EventBatch.created) and ", batch.events_size(),
        " events (EventBatch.events); the limit is ", options_.max_batch_events,
        " in all (limits.max_batch_events)"));
  }
  Session& s = it->second;
  BatchPlan plan;
  DELTAD_RETURN_IF_ERROR(PlanCreations(session, s, batch, plan));
  DELTAD_RETURN_IF_ERROR(PlanEvents(session, s, batch, plan));
  // Sizes are checked one tensor at a time above; their sum is what a
  // session claims to hold, and no process confined to the GPU's budget
  // can hold more than all of it. Counted as the batch leaves it, since
  // creations apply before the frees of the same batch. A batch that
  // lowers the claim always passes, so a session past the limit can get
  // back under it.
  const int64_t held =
      table_.SessionStats(session).committed_bytes() + plan.committed_delta;
  if (plan.committed_delta > 0 && held > gpu_budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " would hold ", held, " bytes on GPU ", gpu_,
        " after this batch (its resident tensors, EventBatch.created and "
        "events); the limit is the GPU's whole budget of ",
        gpu_budget_bytes_, " bytes"));
  }
  return ApplyPlan(s, plan, now_ns, counts);
}

absl::Status GpuPolicy::PlanCreations(SessionId session, const Session& s,
                                      const v1::EventBatch& batch,
                                      BatchPlan& plan) const {
  const int n = batch.created_size();
  // Freed tensors kept for recompute count: a client could otherwise grow
  // the table without bound while holding few live tensors.
  const int64_t records = static_cast<int64_t>(s.locals.size()) + n;
  if (records > options_.max_tensors_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " would hold ", records,
        " tensor records (freed ones still needed for recompute included); "
        "the limit is ",
        options_.max_tensors_per_session, " (limits.max_tensors_per_session)"));
  }
  plan.specs.reserve(n);
  plan.spec_locals.reserve(n);
  for (int i = 0; i < n; ++i) {
    const v1::TensorCreated& c = batch.created(i);
    const uint64_t own = c.tensor_id();
    if (c.bytes() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", own, ": size must be positive, got ", c.bytes()));
    }
    // No tensor can be larger than the memory it lives in.
    if (c.bytes() > gpu_budget_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", own, ": ", c.bytes(), " bytes is more than GPU ", gpu_,
          "'s whole budget of ", gpu_budget_bytes_, " bytes"));
    }
    // Costs are summed over evicted components (a session's tensors, at most
    // max_tensors_per_session of them): bounded per tensor, those sums stay
    // far from int64 overflow. 1e12 ns is a quarter of an hour for one op.
    if (c.compute_cost_ns() < 0 || c.compute_cost_ns() > kMaxComputeCostNs) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", own, ": compute cost must be within 0..",
                       kMaxComputeCostNs, " ns, got ", c.compute_cost_ns()));
    }
    // Real ops read a handful of tensors (a concatenation, a few hundred);
    // linking and unlinking parents costs time under the GPU's lock, which
    // every session on the GPU waits for.
    if (c.parent_ids_size() > kMaxParents) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", own, ": ", c.parent_ids_size(),
          " parents (TensorCreated.parent_ids), the most is ", kMaxParents));
    }
    if (!plan.created.emplace(own, plan.specs.size()).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("tensor ", own, " is created twice in one batch"));
    }
    if (auto known = s.ids.find(own); known != s.ids.end()) {
      const Tensor* t = table_.Find(known->second);
      if (t != nullptr && t->state != TensorState::kFreed) {
        return absl::AlreadyExistsError(absl::StrCat(
            "tensor ", own, " already exists; free it before reusing its id"));
      }
    }
    policy::TensorSpec spec;
    spec.id = next_id_ + static_cast<TensorId>(i);
    spec.session = session;
    spec.gpu = gpu_;
    spec.bytes = c.bytes();
    spec.flags.evict_pinned = c.flags().evict_pinned();
    spec.flags.offload_pinned = c.flags().offload_pinned();
    spec.flags.uncomputable = c.flags().uncomputable();
    spec.compute_cost_ns = c.compute_cost_ns();
    spec.stable_key = c.stable_key();
    plan.committed_delta += spec.bytes;
    plan.specs.push_back(std::move(spec));
    plan.spec_locals.push_back(own);
  }
  // Parents, once every id of the batch is known: they may come later in
  // the batch. Edges inside the batch are kept for the cycle check.
  std::vector<std::vector<size_t>> children(n);
  std::vector<int> pending(n, 0);
  for (int i = 0; i < n; ++i) {
    const v1::TensorCreated& c = batch.created(i);
    for (uint64_t parent : c.parent_ids()) {
      if (parent == c.tensor_id()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", c.tensor_id(), " lists itself as a parent (cycle)"));
      }
      if (auto b = plan.created.find(parent); b != plan.created.end()) {
        children[b->second].push_back(static_cast<size_t>(i));
        ++pending[i];
        plan.specs[i].parents.push_back(plan.specs[b->second].id);
        continue;
      }
      auto known = s.ids.find(parent);
      const Tensor* t =
          known == s.ids.end() ? nullptr : table_.Find(known->second);
      if (t == nullptr) {
        return absl::NotFoundError(absl::StrCat("tensor ", c.tensor_id(),
                                                ": parent ", parent,
                                                " is not a tensor of this "
                                                "session"));
      }
      if (t->state == TensorState::kFreed) {
        return absl::NotFoundError(absl::StrCat(
            "tensor ", c.tensor_id(), ": parent ", parent, " was freed"));
      }
      plan.specs[i].parents.push_back(known->second);
    }
  }
  // Kahn's algorithm over the batch's own edges.
  std::vector<size_t> order;
  for (int i = 0; i < n; ++i) {
    if (pending[i] == 0) order.push_back(static_cast<size_t>(i));
  }
  for (size_t k = 0; k < order.size(); ++k) {
    for (size_t c : children[order[k]]) {
      if (--pending[c] == 0) order.push_back(c);
    }
  }
  if (order.size() != static_cast<size_t>(n)) {
    // What is left is on a cycle or below one; walking up through parents
    // left over reaches the cycle, so the message names a tensor on it.
    size_t i = 0;
    while (pending[i] == 0) ++i;
    std::vector<bool> seen(n, false);
    while (!seen[i]) {
      seen[i] = true;
      for (uint64_t parent : batch.created(static_cast<int>(i)).parent_ids()) {
        auto b = plan.created.find(parent);
        if (b != plan.created.end() && pending[b->second] != 0) {
          i = b->second;
          break;
        }
      }
    }
    return absl::InvalidArgumentError(absl::StrCat("cycle in parents: tensor ",
                                                   plan.spec_locals[i],
                                                   " is its own ancestor"));
  }
  return absl::OkStatus();
}

absl::Status GpuPolicy::PlanEvents(SessionId session, const Session& s,
                                   const v1::EventBatch& batch,
                                   BatchPlan& plan) const {
  using Op = BatchPlan::Op;
  // Each tensor's state as the events so far leave it.
  struct Sim {
    TensorState state;
    bool evicted_from_device;
    policy::TensorFlags flags;
    int64_t bytes;
    TensorState before;  // resident for a tensor created by the batch
    // Still in the state the table had before this batch.
    bool untouched = true;
  };
  // The bytes a tensor in `state` commits on the device (see
  // MemoryStats::committed_bytes).
  auto committed = [](TensorState state, int64_t bytes) -> int64_t {
    return state == TensorState::kResident || state == TensorState::kReloading
               ? bytes
               : 0;
  };
  absl::flat_hash_map<TensorId, Sim> sim;
  absl::flat_hash_set<uint64_t> freed_here;

  for (int i = 0; i < batch.events_size(); ++i) {
    const v1::TensorEvent& e = batch.events(i);
    const uint64_t own = e.tensor_id();
    const int kind = static_cast<int>(e.kind());
    auto error = [&](absl::StatusCode code, absl::string_view what) {
      return absl::Status(code, absl::StrCat("event ", i, " (", KindName(kind),
                                             ") for tensor ", own, ": ", what));
    };
    if (kind == v1::TensorEvent::KIND_UNSPECIFIED ||
        !v1::TensorEvent::Kind_IsValid(kind)) {
      return error(absl::StatusCode::kInvalidArgument, "unknown event kind");
    }
    // The id, as this batch's earlier entries leave it. A freed tensor the
    // table keeps for recompute is as unknown to the client as a retired
    // one, so both answer NOT_FOUND.
    TensorId id = 0;
    // A refusal can cross the order's tensor being freed, or the order
    // being overtaken (the process reloaded the tensor itself): it is then
    // stale and changes nothing, and refusing the batch would lose the rest.
    const bool refusal = kind == v1::TensorEvent::RELEASE_FAILED;
    if (refusal && freed_here.contains(own)) continue;
    if (freed_here.contains(own)) {
      return error(absl::StatusCode::kNotFound,
                   "it was freed earlier in this batch");
    }
    if (auto c = plan.created.find(own); c != plan.created.end()) {
      const policy::TensorSpec& spec = plan.specs[c->second];
      id = spec.id;
      sim.try_emplace(id, Sim{TensorState::kResident, false, spec.flags,
                              spec.bytes, TensorState::kResident});
    } else {
      auto known = s.ids.find(own);
      const Tensor* t =
          known == s.ids.end() ? nullptr : table_.Find(known->second);
      if (t == nullptr) {
        return error(absl::StatusCode::kNotFound,
                     absl::StrCat("session ", session, " has no such tensor"));
      }
      if (refusal && t->state == TensorState::kFreed) continue;
      if (t->state == TensorState::kFreed) {
        return error(absl::StatusCode::kNotFound, "it was freed");
      }
      id = known->second;
      sim.try_emplace(id, Sim{t->state, t->evicted_from_device, t->flags,
                              t->bytes, t->state});
    }
    Sim& t = sim.at(id);
    const TensorState from = t.state;
    auto illegal = [&](absl::string_view allowed) {
      return error(absl::StatusCode::kFailedPrecondition,
                   absl::StrCat("the tensor is ", policy::TensorStateName(from),
                                "; allowed only when ", allowed));
    };
    auto set = [&](TensorState to) {
      t.untouched = false;
      plan.steps.push_back({Op::kSetState, id, to});
      if (to == TensorState::kEvicted) {
        t.evicted_from_device = t.state == TensorState::kResident;
      }
      t.state = to;
    };
    // The table's own rules on flags, checked here so that the batch fails
    // whole, before anything is applied. No lock is ever taken on this
    // table, so lock counts need no check.
    const bool may_evict = !t.flags.evict_pinned && !t.flags.uncomputable;

    switch (e.kind()) {
      case v1::TensorEvent::ACCESSED:
        if (from == TensorState::kEvicted && t.evicted_from_device &&
            t.untouched) {
          // An evict order the process has not seen yet: its op used the
          // tensor meanwhile, and it will refuse the order (RELEASE_FAILED)
          // or carry it out later. The access is real but there is nothing
          // resident to touch; refusing the batch would lose its other
          // events.
          break;
        }
        if (!policy::OccupiesDevice(from)) {
          return illegal(
              "its bytes are on the device (resident, offloading "
              "or reloading)");
        }
        plan.steps.push_back({Op::kTouch, id});
        break;
      case v1::TensorEvent::FREED:
        plan.steps.push_back({Op::kFree, id});
        t.state = TensorState::kFreed;
        t.untouched = false;
        freed_here.insert(own);
        break;
      case v1::TensorEvent::OFFLOADED:
        if (from == TensorState::kResident) {
          // The process offloaded on its own: the copy went through the
          // offloading state too, whether the daemon saw it or not.
          if (t.flags.offload_pinned) {
            return error(absl::StatusCode::kFailedPrecondition,
                         "the tensor is offload-pinned");
          }
          set(TensorState::kOffloading);
          set(TensorState::kOffloaded);
        } else if (from == TensorState::kOffloading ||
                   from == TensorState::kReloading) {
          // Reloading: the reload was abandoned, the host copy remains.
          set(TensorState::kOffloaded);
        } else {
          return illegal("resident, offloading or reloading");
        }
        break;
      case v1::TensorEvent::RELOADED:
        if (from != TensorState::kReloading &&
            from != TensorState::kOffloaded) {
          return illegal("offloaded or reloading");
        }
        set(TensorState::kResident);
        break;
      case v1::TensorEvent::EVICTED:
        if (from == TensorState::kEvicted) {  // confirms an evict order
          ++plan.confirmed_evictions;
          break;
        }
        if (from != TensorState::kResident && from != TensorState::kOffloaded) {
          return illegal("resident or offloaded");
        }
        if (!may_evict) {
          return error(absl::StatusCode::kFailedPrecondition,
                       t.flags.uncomputable
                           ? "the tensor is uncomputable: evicting it would "
                             "lose its bytes"
                           : "the tensor is evict-pinned");
        }
        set(TensorState::kEvicted);
        break;
      case v1::TensorEvent::RECOMPUTED:
        if (from != TensorState::kEvicted && from != TensorState::kOffloaded) {
          return illegal("evicted or offloaded");
        }
        if (t.flags.uncomputable) {
          return error(absl::StatusCode::kFailedPrecondition,
                       "the tensor is uncomputable");
        }
        plan.steps.push_back({Op::kRecompute, id});
        t.state = TensorState::kResident;
        t.untouched = false;
        break;
      case v1::TensorEvent::RELEASE_FAILED:
        if (from == TensorState::kOffloading ||
            (from == TensorState::kEvicted && t.evicted_from_device)) {
          plan.steps.push_back({Op::kCancel, id});
          t.state = TensorState::kResident;
          t.untouched = false;
        } else if (from == TensorState::kReloading) {
          // A prefetch is an order too; failing it leaves the host copy.
          set(TensorState::kOffloaded);
        }
        // Otherwise stale: no order of this tensor is outstanding any more.
        break;
      default:
        return error(absl::StatusCode::kInvalidArgument, "unknown event kind");
    }
  }
  for (const auto& [id, t] : sim) {
    plan.committed_delta +=
        committed(t.state, t.bytes) - committed(t.before, t.bytes);
  }
  return absl::OkStatus();
}

absl::Status GpuPolicy::ApplyPlan(Session& s, const BatchPlan& plan,
                                  int64_t now_ns, AppliedCounts* counts) {
  AppliedCounts unused;
  AppliedCounts& c = counts != nullptr ? *counts : unused;
  c.evictions += plan.confirmed_evictions;
  using Op = BatchPlan::Op;
  // Atomic in the table; nothing else has changed if it refuses.
  if (!plan.specs.empty()) {
    DELTAD_RETURN_IF_ERROR(table_.AddBatch(plan.specs, now_ns));
  }
  next_id_ += plan.specs.size();
  for (size_t i = 0; i < plan.specs.size(); ++i) {
    // A reused id now names the new tensor; a freed one it named before
    // stays in `locals` until the table retires it.
    s.ids[plan.spec_locals[i]] = plan.specs[i].id;
    s.locals[plan.specs[i].id] = plan.spec_locals[i];
  }
  // Events carry the process's clock, which the Filter cannot compare with
  // other processes' clocks; every access is stamped with the daemon's.
  for (const BatchPlan::Step& step : plan.steps) {
    absl::Status applied;
    switch (step.op) {
      case Op::kTouch:
        applied = table_.Touch(step.id, now_ns);
        break;
      case Op::kFree:
        applied = FreeAndForget(s, step.id);
        refused_at_.erase(step.id);
        break;
      case Op::kSetState: {
        const Tensor* t = table_.Find(step.id);
        const TensorState from = t->state;
        const int64_t bytes = t->bytes;
        applied = table_.SetState(step.id, step.to);
        if (!applied.ok()) break;
        if (step.to == TensorState::kOffloaded) {
          s.prefetcher->OnOffloaded(step.id);
          if (from == TensorState::kOffloading) c.offloaded_bytes += bytes;
        } else if (step.to == TensorState::kResident &&
                   (from == TensorState::kReloading ||
                    from == TensorState::kOffloaded)) {
          // Prefetched (reloading), or reloaded on the process's own.
          c.reloaded_bytes += bytes;
        } else if (step.to == TensorState::kEvicted &&
                   from == TensorState::kResident) {
          ++c.evictions;
        }
        break;
      }
      case Op::kCancel:
        applied = table_.CancelRelease(step.id);
        if (applied.ok()) refused_at_[step.id] = now_ns;
        break;
      case Op::kRecompute:
        applied = table_.MarkRecomputed(step.id, now_ns);
        if (applied.ok()) {
          ++c.recomputes;
          c.recompute_ns += table_.Find(step.id)->compute_cost_ns;
        }
        break;
    }
    if (!applied.ok()) {
      // PlanEvents mirrors the table's rules; a refusal here means they
      // drifted apart, and part of the batch has been applied.
      return absl::InternalError(
          absl::StrCat("batch partly applied, the table refused a validated "
                       "event: ",
                       applied.message()));
    }
  }
  return absl::OkStatus();
}

std::vector<TensorId> GpuPolicy::RetiredByFree(TensorId id) const {
  std::vector<TensorId> out;
  const uint32_t slot = table_.SlotOf(id);
  if (slot == UINT32_MAX || table_.AtSlot(slot).live_children != 0) return out;
  // The table's cascade, played on counts: a parent retires when it is
  // freed and its last live child retires.
  absl::flat_hash_map<uint32_t, uint32_t> live_children;
  std::vector<uint32_t> work{slot};
  while (!work.empty()) {
    const Tensor& t = table_.AtSlot(work.back());
    work.pop_back();
    out.push_back(t.id);
    for (uint32_t p : t.parents) {
      const Tensor& parent = table_.AtSlot(p);
      auto left = live_children.try_emplace(p, parent.live_children).first;
      if (--left->second == 0 && parent.state == TensorState::kFreed) {
        work.push_back(p);
      }
    }
  }
  return out;
}

absl::Status GpuPolicy::FreeAndForget(Session& s, TensorId id) {
  const std::vector<TensorId> retiring = RetiredByFree(id);
  DELTAD_RETURN_IF_ERROR(table_.Free(id));
  for (TensorId gone : retiring) {
    if (table_.Contains(gone)) continue;
    auto own = s.locals.find(gone);
    if (own == s.locals.end()) continue;
    // The id may already name a newer tensor: drop only this one's mapping.
    if (auto m = s.ids.find(own->second); m != s.ids.end() && m->second == gone)
      s.ids.erase(m);
    s.locals.erase(own);
  }
  return absl::OkStatus();
}

// --- Releases ----------------------------------------------------------------

int64_t GpuPolicy::HostLeft(SessionId session, const Session& s) const {
  return std::max<int64_t>(
      0, s.host_quota_bytes - table_.SessionStats(session).host_bytes);
}

int64_t GpuPolicy::AccountableBytes(SessionId session) const {
  int64_t sum = 0;
  for (const auto& [id, s] : sessions_) {
    const int64_t held = table_.SessionStats(id).committed_bytes();
    sum += id == session ? held : std::min(held, s.budget_bytes);
  }
  return sum;
}

void GpuPolicy::Count(const policy::ReleaseOrder& order, SessionId requester,
                      Shortage& shortage) const {
  shortage.freed += order.bytes;
  if (table_.Find(order.id)->session == requester) {
    shortage.own_freed += order.bytes;
  }
}

absl::flat_hash_map<SessionId, GpuPolicy::Victim> GpuPolicy::Victims(
    SessionId requester, int64_t incoming, Tier tier) const {
  absl::flat_hash_map<SessionId, Victim> out;
  for (const auto& [id, s] : sessions_) {
    if (tier == Tier::kRequester) {
      if (id == requester) {
        out.emplace(
            id, Victim{HostLeft(id, s), std::numeric_limits<int64_t>::max()});
      }
      continue;
    }
    // An order to a session without a stream would free nothing.
    if (id != requester && !s.reachable) continue;
    const int64_t held = table_.SessionStats(id).committed_bytes() +
                         (id == requester ? incoming : 0);
    if (held > s.budget_bytes) {
      out.emplace(id, Victim{HostLeft(id, s), held - s.budget_bytes});
    }
  }
  return out;
}

absl::StatusOr<policy::ReleaseOrder> GpuPolicy::ReleaseOne(SessionId requester,
                                                           int64_t incoming,
                                                           Tier tier,
                                                           int64_t now_ns) {
  // Victims and host are read afresh for each tensor: the last release may
  // have brought its session down to its share or used its host quota.
  const absl::flat_hash_map<SessionId, Victim> victims =
      Victims(requester, incoming, tier);
  if (victims.empty()) {
    return absl::NotFoundError("no session may lose tensors");
  }
  int64_t most_host = 0;
  for (const auto& [id, v] : victims) {
    most_host = std::max(most_host, v.host_left);
  }
  // An offload is priced behind the copies already queued on the link.
  costs_.SetOffloadBacklog(gpu_, table_.GpuStats(gpu_).releasing_bytes);
  policy::ReleasePlanner planner(table_, filter_, director_);
  // One tensor per call. The planner takes one host figure, but each session
  // offloads into its own quota: the eligibility checks the owner's quota,
  // and the figure passed is the largest, so it never refuses what the
  // owner's quota allows.
  // One session may lose tensors (often the requester alone): search its
  // own candidates, not the whole GPU's, where a sample would mostly draw
  // tensors of sessions that may not lose any.
  const policy::Scope scope = victims.size() == 1
                                  ? policy::Scope{gpu_, victims.begin()->first}
                                  : policy::Scope{gpu_, std::nullopt};
  absl::StatusOr<std::vector<policy::ReleaseOrder>> orders =
      planner.Release(scope, 1, now_ns, most_host, [&](const Tensor& t) {
        auto v = victims.find(t.session);
        return v != victims.end() && t.bytes <= v->second.max_bytes &&
               director_.CanRelease(t, v->second.host_left);
      });
  if (!orders.ok()) return orders.status();
  policy::ReleaseOrder order = orders->front();
  if (order.action == policy::ReleaseAction::kOffload) {
    const SessionId owner = table_.Find(order.id)->session;
    if (table_.SessionStats(owner).host_bytes >
        sessions_.at(owner).host_quota_bytes) {
      // The Director saw the larger figure; with the owner's own it would
      // have evicted (the eligibility made sure the tensor may be evicted).
      DELTAD_RETURN_IF_ERROR(table_.CancelRelease(order.id));
      DELTAD_RETURN_IF_ERROR(table_.SetState(order.id, TensorState::kEvicted));
      order.action = policy::ReleaseAction::kEvict;
    }
  }
  return order;
}

std::optional<policy::ReleaseOrder> GpuPolicy::OffloadOneAhead(
    SessionId requester, Tier tier, int64_t now_ns) {
  const absl::flat_hash_map<SessionId, Victim> victims =
      Victims(requester, 0, tier);
  if (victims.empty()) return std::nullopt;
  int64_t most_host = 0;
  for (const auto& [id, v] : victims) {
    most_host = std::max(most_host, v.host_left);
  }
  costs_.SetOffloadBacklog(gpu_, table_.GpuStats(gpu_).releasing_bytes);
  policy::ReleasePlanner planner(table_, filter_, director_);
  // Only offloads: a tensor that fits its owner's quota gets the same
  // decision from the Director under the larger figure.
  std::vector<policy::ReleaseOrder> orders = planner.OffloadAhead(
      policy::Scope{gpu_, std::nullopt}, 1, now_ns, most_host,
      [&](const Tensor& t) {
        auto v = victims.find(t.session);
        if (auto r = refused_at_.find(t.id);
            r != refused_at_.end() && now_ns - r->second < kRefusalBackoffNs) {
          return false;
        }
        return v != victims.end() && t.bytes <= v->second.host_left &&
               t.bytes <= v->second.max_bytes;
      });
  if (orders.empty()) return std::nullopt;
  return orders.front();
}

std::pair<SessionId, v1::ReleaseOrder> GpuPolicy::ToWire(
    const policy::ReleaseOrder& order) const {
  const SessionId owner = table_.Find(order.id)->session;
  v1::ReleaseOrder out;
  out.set_tensor_id(sessions_.at(owner).locals.at(order.id));
  out.set_action(order.action == policy::ReleaseAction::kOffload
                     ? v1::ReleaseOrder::OFFLOAD
                     : v1::ReleaseOrder::EVICT);
  out.set_bytes(order.bytes);
  return {owner, std::move(out)};
}

absl::StatusOr<std::map<SessionId, std::vector<v1::ReleaseOrder>>>
GpuPolicy::MakeRoom(SessionId session, int64_t bytes, int64_t now_ns) {
  if (!sessions_.contains(session)) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("room asked must not be negative, got ", bytes, " bytes"));
  }
  if (bytes > gpu_budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " asks room for ", bytes, " bytes, more than GPU ",
        gpu_, "'s whole budget of ", gpu_budget_bytes_,
        " bytes; no release can make that much room"));
  }
  // The rule: release what the GPU lacks, max(0, committed bytes of the GPU
  // + bytes - GPU budget). Below the budget nothing is released even when
  // the session passes its share; a session's share only decides who loses
  // tensors (see Victims). The requester's own excess is not added: when it
  // is over its share it is among the first victims anyway, and adding its
  // excess would release memory nobody asked for.
  Shortage shortage;
  shortage.gpu =
      table_.GpuStats(gpu_).committed_bytes() + bytes - gpu_budget_bytes_;
  std::map<SessionId, std::vector<v1::ReleaseOrder>> out;
  if (shortage.gpu <= 0) return out;
  // Others' claims beyond their shares are theirs to release: what of them
  // stays (pinned, or never real) must cost the requester nothing.
  shortage.own = AccountableBytes(session) + bytes - gpu_budget_bytes_;

  std::vector<policy::ReleaseOrder> chosen;
  absl::Status failure;
  for (Tier tier : {Tier::kOverShare, Tier::kRequester}) {
    while (shortage.Wants(tier) && failure.ok()) {
      absl::StatusOr<policy::ReleaseOrder> order =
          ReleaseOne(session, bytes, tier, now_ns);
      if (!order.ok()) {
        if (!NothingToRelease(order.status())) failure = order.status();
        break;
      }
      Count(*order, session, shortage);
      chosen.push_back(*order);
    }
  }
  // Others release only down to their shares, so the requester's part is
  // met whenever the whole lack is.
  if (shortage.own_freed < shortage.own || !failure.ok()) {
    // All or nothing: undo in reverse so the table ends as it began.
    for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) {
      DELTAD_RETURN_IF_ERROR(table_.CancelRelease(it->id));
    }
    if (!failure.ok()) return failure;
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " asks room for ", bytes, " bytes: GPU ", gpu_,
        " must release ", shortage.gpu, " bytes, ", shortage.own,
        " of them from the asking session (its own bytes, and other "
        "sessions' up to their shares); can free at most ",
        shortage.freed, " bytes, ", shortage.own_freed,
        " of them the asking session's (victims may come only from sessions "
        "above their share and from the asking session; the rest is within "
        "other sessions' shares, pinned, or needs host memory their quotas "
        "lack)"));
  }
  for (const policy::ReleaseOrder& o : chosen) {
    // The asking session gets its own orders in the answer; the others'
    // go on their streams.
    auto [owner, wire] = Order(o, /*on_stream_unless=*/session);
    out[owner].push_back(std::move(wire));
  }
  return out;
}

std::pair<SessionId, v1::ReleaseOrder> GpuPolicy::Order(
    const policy::ReleaseOrder& order, SessionId on_stream_unless) {
  auto ordered = ToWire(order);
  Session& owner = sessions_.at(ordered.first);
  ++owner.releases_ordered;
  if (ordered.first != on_stream_unless) {
    NoteStreamRelease(owner, ordered.first, order.id);
  }
  return ordered;
}

std::optional<policy::ReleaseAction> GpuPolicy::Outstanding(const Tensor* t,
                                                            SessionId session) {
  if (t == nullptr || t->session != session) return std::nullopt;
  if (t->state == TensorState::kOffloading) {
    return policy::ReleaseAction::kOffload;
  }
  if (t->state == TensorState::kEvicted && t->evicted_from_device) {
    return policy::ReleaseAction::kEvict;
  }
  return std::nullopt;
}

void GpuPolicy::NoteStreamRelease(Session& owner, SessionId owner_id,
                                  TensorId id) {
  owner.stream_releases.push_back(id);
  if (owner.stream_releases.size() < owner.stream_releases_cap) return;
  std::erase_if(owner.stream_releases, [&](TensorId t) {
    return !Outstanding(table_.Find(t), owner_id).has_value();
  });
  // Doubling keeps the pruning amortised O(1) per order.
  owner.stream_releases_cap =
      std::max<size_t>(4096, 2 * owner.stream_releases.size());
}

std::vector<v1::ReleaseOrder> GpuPolicy::TakeStreamReleases(SessionId session) {
  std::vector<v1::ReleaseOrder> out;
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return out;
  std::vector<TensorId> ids;
  ids.swap(it->second.stream_releases);
  it->second.stream_releases_cap = 4096;
  for (TensorId id : ids) {
    const Tensor* t = table_.Find(id);
    const std::optional<policy::ReleaseAction> action = Outstanding(t, session);
    if (!action) continue;
    out.push_back(ToWire({id, *action, t->bytes}).second);
  }
  return out;
}

// --- Plan --------------------------------------------------------------------

std::map<SessionId, v1::Orders> GpuPolicy::Plan(SessionId session,
                                                int64_t now_ns) {
  std::map<SessionId, v1::Orders> out;
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return out;
  // Refusals long past, and those of tensors gone with their session.
  if (refused_at_.size() > 4096) {
    absl::erase_if(refused_at_, [&](const auto& r) {
      return now_ns - r.second >= kRefusalBackoffNs ||
             table_.Find(r.first) == nullptr;
    });
  }

  // DELTA's early start, over the GPU: above the high watermark, offload
  // down to the low one, from the same victims as MakeRoom, so that copies
  // overlap compute instead of an allocation waiting for them later.
  // The session's own tensors go only toward its own part, as in MakeRoom.
  absl::StatusOr<int64_t> to_free = watermarks_.BytesToFree(
      table_.GpuStats(gpu_).committed_bytes(), 0, gpu_budget_bytes_);
  absl::StatusOr<int64_t> own_to_free =
      watermarks_.BytesToFree(AccountableBytes(session), 0, gpu_budget_bytes_);
  if (to_free.ok() && *to_free > 0 && own_to_free.ok()) {
    Shortage shortage;
    shortage.gpu = *to_free;
    shortage.own = *own_to_free;
    for (Tier tier : {Tier::kOverShare, Tier::kRequester}) {
      while (shortage.Wants(tier)) {
        std::optional<policy::ReleaseOrder> order =
            OffloadOneAhead(session, tier, now_ns);
        if (!order) break;
        Count(*order, session, shortage);
        // Every one on a stream, the session's own included.
        auto [owner, wire] = Order(*order, /*on_stream_unless=*/0);
        *out[owner].add_release() = std::move(wire);
      }
    }
  }

  // Prefetch for the session, up to the high watermark of its budget, and
  // never past that of the GPU counting offloads still in flight: a reload
  // allocates now, and past the mark it would only be offloaded again.
  Session& s = it->second;
  std::erase_if(s.reloading, [&](TensorId id) {
    const Tensor* t = table_.Find(id);
    return t == nullptr || t->state != TensorState::kReloading;
  });
  const int64_t room =
      std::min(Fraction(watermarks_.high(), s.budget_bytes) -
                   table_.SessionStats(session).committed_bytes(),
               Fraction(watermarks_.high(), gpu_budget_bytes_) -
                   table_.GpuStats(gpu_).device_bytes);
  if (room > 0) {
    const std::vector<TensorId> ids = s.prefetcher->Plan(
        table_, room, static_cast<int>(s.reloading.size()), nullptr, session);
    for (TensorId id : ids) {
      if (!table_.SetState(id, TensorState::kReloading).ok()) continue;
      s.reloading.push_back(id);
      out[session].add_prefetch_tensor_ids(s.locals.at(id));
    }
  } else if (s.prefetcher->queued() > 2 * s.locals.size() + 64) {
    // Without room the session does not plan, and the queue would keep every
    // offload while it stays above its mark.
    s.prefetcher->DropStale(table_);
  }
  return out;
}

absl::Status GpuPolicy::SetReachable(SessionId session, bool reachable) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  it->second.reachable = reachable;
  return absl::OkStatus();
}

void GpuPolicy::Undeliverable(SessionId session, const v1::Orders& orders) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  Session& s = it->second;
  for (const v1::ReleaseOrder& o : orders.release()) {
    auto id = s.ids.find(o.tensor_id());
    if (id == s.ids.end()) continue;
    // A release the table still shows in flight goes back to resident.
    (void)table_.CancelRelease(id->second);
  }
  for (uint64_t own : orders.prefetch_tensor_ids()) {
    auto id = s.ids.find(own);
    if (id == s.ids.end()) continue;
    const Tensor* t = table_.Find(id->second);
    if (t != nullptr && t->state == TensorState::kReloading) {
      (void)table_.SetState(id->second, TensorState::kOffloaded);
      std::erase(s.reloading, id->second);
    }
  }
}

// --- Usage -------------------------------------------------------------------

absl::StatusOr<SessionUsage> GpuPolicy::Usage(SessionId session) const {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  const policy::MemoryStats stats = table_.SessionStats(session);
  SessionUsage u;
  u.budget_bytes = it->second.budget_bytes;
  u.host_quota_bytes = it->second.host_quota_bytes;
  u.device_bytes = stats.committed_bytes();
  u.host_bytes = stats.host_bytes;
  u.tensors = stats.tensors;
  u.releases_ordered = it->second.releases_ordered;
  return u;
}

absl::StatusOr<std::vector<v1::TensorStatus>> GpuPolicy::LargestTensors(
    SessionId session, size_t limit, int64_t now_ns) const {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  // `locals` holds every record of the session, so nothing of another
  // session can show up here.
  std::vector<std::pair<const Tensor*, uint64_t>> live;
  live.reserve(it->second.locals.size());
  for (const auto& [id, local] : it->second.locals) {
    const Tensor* t = table_.Find(id);
    if (t == nullptr || t->state == TensorState::kFreed) continue;
    live.emplace_back(t, local);
  }
  const size_t n = std::min(limit, live.size());
  // Ties broken by id so that repeated calls list the same tensors.
  std::partial_sort(live.begin(), live.begin() + static_cast<ptrdiff_t>(n),
                    live.end(), [](const auto& a, const auto& b) {
                      if (a.first->bytes != b.first->bytes) {
                        return a.first->bytes > b.first->bytes;
                      }
                      return a.second < b.second;
                    });
  std::vector<v1::TensorStatus> out(n);
  for (size_t i = 0; i < n; ++i) {
    const Tensor& t = *live[i].first;
    v1::TensorStatus& s = out[i];
    s.set_tensor_id(live[i].second);
    s.set_bytes(t.bytes);
    s.set_state(std::string(policy::TensorStateName(t.state)));
    s.set_recomputes(t.recompute_count);
    s.set_idle_ns(std::max<int64_t>(0, now_ns - t.last_access_ns));
  }
  return out;
}

int64_t GpuPolicy::device_bytes() const {
  return table_.GpuStats(gpu_).committed_bytes();
}

}  // namespace deltad::daemon
