// GpuPolicy::Apply: a session's batch validated whole, then applied.

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "daemon/gpu_policy.h"
#include "policies/status_macros.h"

namespace deltad::daemon {

using policy::Tensor;
using policy::TensorId;
using policy::TensorState;

namespace {

constexpr int kMaxParents = 4096;

std::string KindName(int kind) {
  const std::string& name = v1::TensorEvent::Kind_Name(kind);
  return name.empty() ? absl::StrCat("kind ", kind) : name;
}

}  // namespace

// A batch checked against the table and against its own earlier entries:
// applying it cannot fail. The table is not copyable, so "all or nothing"
// is done by validating first and applying second, rather than applying to a
// copy. Each event becomes the table calls it stands for, chosen from the
// state the tensor will be in by then.
struct GpuPolicy::BatchPlan {
  enum class Op { kTouch, kFree, kSetState, kCancel, kRecompute, kHostCopy };
  struct Step {
    Op op;
    TensorId id;
    TensorState to = TensorState::kResident;  // kSetState only
    bool copied = false;                      // kHostCopy only
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
    // Bounded so that cost sums cannot overflow (see kMaxComputeCostNs).
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
        // Offloading: the process evicted it on its own before it read the
        // offload order (its plan cannot see orders still on the stream).
        // The eviction stands; the order's refusal that follows is stale,
        // since the tensor is not evicted from the device by an order.
        if (from != TensorState::kResident && from != TensorState::kOffloaded &&
            from != TensorState::kOffloading) {
          return illegal("resident, offloading or offloaded");
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
      case v1::TensorEvent::HOST_COPIED:
      case v1::TensorEvent::HOST_COPY_DROPPED:
        // Only a resident tensor's copy prices its release. Otherwise an
        // order of the daemon's crossed it: the process offloads from the
        // copy (or has dropped it), and leaving the resident state clears
        // the mark anyway.
        if (from == TensorState::kResident) {
          BatchPlan::Step step{Op::kHostCopy, id};
          step.copied = e.kind() == v1::TensorEvent::HOST_COPIED;
          plan.steps.push_back(step);
          t.flags.host_copy = step.copied;
        }
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
        if (applied.ok()) {
          const Tensor* t = table_.Find(step.id);
          s.order->OnAccess(t->stable_key, t->bytes);
        }
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
          if (from == TensorState::kReloading) {  // a prefetch refused
            const int shift =
                std::min(s.prefetch_refusals++, kMaxPrefetchHoldShift);
            s.prefetch_held_until_ns = now_ns + (kRefusalBackoffNs << shift);
          }
        } else if (step.to == TensorState::kResident &&
                   (from == TensorState::kReloading ||
                    from == TensorState::kOffloaded)) {
          // Prefetched (reloading), or reloaded on the process's own.
          c.reloaded_bytes += bytes;
          if (from == TensorState::kReloading) s.prefetch_refusals = 0;
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
      case Op::kHostCopy:
        applied = table_.SetHostCopy(step.id, step.copied);
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

}  // namespace deltad::daemon
