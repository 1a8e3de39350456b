#include "policies/tensor_table.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "policies/status_macros.h"

namespace deltad::policy {

absl::string_view TensorStateName(TensorState state) {
  switch (state) {
    case TensorState::kResident:
      return "resident";
    case TensorState::kOffloading:
      return "offloading";
    case TensorState::kOffloaded:
      return "offloaded";
    case TensorState::kReloading:
      return "reloading";
    case TensorState::kEvicted:
      return "evicted";
    case TensorState::kFreed:
      return "freed";
  }
  return "unknown";
}

namespace {

constexpr uint32_t kNoSlot = UINT32_MAX;

bool HostCopyExists(TensorState s) {
  return s == TensorState::kOffloading || s == TensorState::kOffloaded ||
         s == TensorState::kReloading;
}

// Legal moves for SetState. Recompute and free have their own calls.
bool TransitionAllowed(TensorState from, TensorState to) {
  using S = TensorState;
  switch (from) {
    case S::kResident:
      return to == S::kOffloading || to == S::kEvicted;
    case S::kOffloading:  // copy finished, cancelled, or the offload order
                          // overtaken by the process's own eviction
      return to == S::kOffloaded || to == S::kResident || to == S::kEvicted;
    case S::kOffloaded:  // reload started, reload done at once, host copy
                         // dropped
      return to == S::kReloading || to == S::kResident || to == S::kEvicted;
    case S::kReloading:  // copy finished, or cancelled
      return to == S::kResident || to == S::kOffloaded;
    case S::kEvicted:
    case S::kFreed:
      return false;
  }
  return false;
}

}  // namespace

absl::StatusOr<uint32_t> TensorTable::SlotFor(TensorId id) const {
  auto it = index_.find(id);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown tensor id ", id));
  }
  return it->second;
}

uint32_t TensorTable::SlotOf(TensorId id) const {
  auto it = index_.find(id);
  return it == index_.end() ? kNoSlot : it->second;
}

absl::StatusOr<const Tensor*> TensorTable::Get(TensorId id) const {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  return &slots_[*slot];
}

const Tensor* TensorTable::Find(TensorId id) const {
  const uint32_t slot = SlotOf(id);
  return slot == kNoSlot ? nullptr : &slots_[slot];
}

const Tensor* TensorTable::FindByKey(SessionId session, uint64_t key) const {
  auto it = by_key_.find(std::make_pair(session, key));
  return it == by_key_.end() ? nullptr : &slots_[it->second];
}

absl::Status TensorTable::ValidateSpec(const TensorSpec& spec) const {
  if (spec.id == 0) {
    return absl::InvalidArgumentError("tensor id 0 is reserved");
  }
  if (spec.bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", spec.id, ": size must be positive, got ", spec.bytes));
  }
  if (spec.gpu < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", spec.id, ": negative GPU index ", spec.gpu));
  }
  if (spec.compute_cost_ns < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", spec.id, ": negative compute cost ",
                     spec.compute_cost_ns, " ns"));
  }
  if (auto it = session_gpu_.find(spec.session);
      it != session_gpu_.end() && it->second != spec.gpu) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", spec.id, ": session ", spec.session,
                     " is bound to GPU ", it->second, ", not GPU ", spec.gpu));
  }
  if (index_.contains(spec.id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("duplicate tensor id ", spec.id));
  }
  return absl::OkStatus();
}

absl::Status TensorTable::Add(const TensorSpec& spec, int64_t now_ns) {
  // One tensor needs none of a batch's bookkeeping (a map of its ids, the
  // order of its edges), which cost more than the rest of an add: the same
  // checks, made directly.
  DELTAD_RETURN_IF_ERROR(ValidateSpec(spec));
  for (TensorId p : spec.parents) {
    if (p == spec.id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", spec.id, " lists itself as a parent (cycle)"));
    }
    DELTAD_RETURN_IF_ERROR(CheckParentInTable(spec, p));
  }
  LinkParents(Insert(spec, now_ns), spec.parents);
  return absl::OkStatus();
}

absl::Status TensorTable::CheckParentInTable(const TensorSpec& spec,
                                             TensorId p) const {
  const Tensor* parent = Find(p);
  if (parent == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tensor ", spec.id, ": parent ", p, " does not exist"));
  }
  if (parent->session != spec.session) {
    return absl::PermissionDeniedError(absl::StrCat(
        "tensor ", spec.id, ": parent ", p, " belongs to another session"));
  }
  if (parent->state == TensorState::kFreed) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", spec.id, ": parent ", p, " was freed"));
  }
  return absl::OkStatus();
}

absl::Status TensorTable::AddBatch(absl::Span<const TensorSpec> specs,
                                   int64_t now_ns) {
  // Validate everything before touching the table: a batch lands whole.
  absl::flat_hash_map<TensorId, size_t> in_batch;
  in_batch.reserve(specs.size());
  absl::flat_hash_map<SessionId, GpuId> batch_gpu;
  for (size_t i = 0; i < specs.size(); ++i) {
    DELTAD_RETURN_IF_ERROR(ValidateSpec(specs[i]));
    if (!in_batch.emplace(specs[i].id, i).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("duplicate tensor id ", specs[i].id, " in one batch"));
    }
    const auto [it, fresh] = batch_gpu.emplace(specs[i].session, specs[i].gpu);
    if (!fresh && it->second != specs[i].gpu) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", specs[i].id, ": session ", specs[i].session,
          " is bound to GPU ", it->second, ", not GPU ", specs[i].gpu));
    }
  }
  // Edges inside the batch, for the cycle check (Kahn's algorithm).
  std::vector<std::vector<size_t>> batch_children(specs.size());
  std::vector<size_t> pending_parents(specs.size(), 0);
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    for (TensorId p : s.parents) {
      if (p == s.id) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", s.id, " lists itself as a parent (cycle)"));
      }
      if (auto b = in_batch.find(p); b != in_batch.end()) {
        if (specs[b->second].session != s.session) {
          return absl::PermissionDeniedError(absl::StrCat(
              "tensor ", s.id, ": parent ", p, " belongs to another session"));
        }
        batch_children[b->second].push_back(i);
        ++pending_parents[i];
        continue;
      }
      DELTAD_RETURN_IF_ERROR(CheckParentInTable(s, p));
    }
  }
  std::vector<size_t> order;
  order.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (pending_parents[i] == 0) order.push_back(i);
  }
  for (size_t k = 0; k < order.size(); ++k) {
    for (size_t c : batch_children[order[k]]) {
      if (--pending_parents[c] == 0) order.push_back(c);
    }
  }
  if (order.size() != specs.size()) {
    // Tensors left over are on a cycle or below one. Each has a parent left
    // over, so walking up parents left over must come back to a tensor on
    // the cycle: name that one, not one that merely depends on the cycle.
    size_t i = 0;
    while (pending_parents[i] == 0) ++i;
    std::vector<bool> seen(specs.size(), false);
    while (!seen[i]) {
      seen[i] = true;
      for (TensorId p : specs[i].parents) {
        auto b = in_batch.find(p);
        if (b != in_batch.end() && pending_parents[b->second] != 0) {
          i = b->second;
          break;
        }
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "cycle in parents: tensor ", specs[i].id, " is its own ancestor"));
  }
  for (size_t i : order) {
    const uint32_t slot = Insert(specs[i], now_ns);
    LinkParents(slot, specs[i].parents);
  }
  return absl::OkStatus();
}

uint32_t TensorTable::Insert(const TensorSpec& spec, int64_t now_ns) {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.PopLowest();
  } else {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  Tensor& t = slots_[slot];
  t.Reset();
  t.id = spec.id;
  t.session = spec.session;
  t.gpu = spec.gpu;
  t.bytes = spec.bytes;
  t.flags = spec.flags;
  t.compute_cost_ns = spec.compute_cost_ns;
  t.stable_key = spec.stable_key;
  t.state = TensorState::kResident;
  t.last_access_tick = ++sessions_[spec.session].clock;
  t.last_access_ns = now_ns;
  index_.emplace(spec.id, slot);
  session_gpu_.emplace(spec.session, spec.gpu);
  if (spec.stable_key != 0) by_key_[{spec.session, spec.stable_key}] = slot;
  Account(t, +1);
  AddCandidate(slot);
  return slot;
}

void TensorTable::LinkParents(uint32_t slot, absl::Span<const TensorId> ids) {
  listed_.Clear(slots_.size());
  auto& parents = slots_[slot].parents;
  for (uint32_t ps : parents) listed_.insert(ps);
  for (TensorId p : ids) {
    const uint32_t ps = index_.at(p);
    if (!listed_.insert(ps)) continue;  // listed twice
    parents.push_back(ps);
    slots_[ps].children.push_back(slot);
    ++slots_[ps].live_children;
  }
}

void TensorTable::Account(const Tensor& t, int sign) {
  for (Group* g : {&gpus_[t.gpu], &sessions_[t.session]}) {
    MemoryStats& s = g->stats;
    if (OccupiesDevice(t.state)) s.device_bytes += sign * t.bytes;
    if (t.state == TensorState::kOffloading)
      s.releasing_bytes += sign * t.bytes;
    if (HostCopyExists(t.state)) s.host_bytes += sign * t.bytes;
    if (t.state == TensorState::kEvicted) s.evicted_bytes += sign * t.bytes;
    if (t.state != TensorState::kFreed) s.tensors += sign;
  }
}

void TensorTable::AddCandidate(uint32_t slot) {
  ++rank_epoch_;
  Tensor& t = slots_[slot];
  const CandidateEntry entry = CandidateEntry::Of(t, slot);
  CandidateList& g = gpus_[t.gpu].candidates;
  t.gpu_pos = static_cast<uint32_t>(g.entries.size());
  g.entries.push_back(entry);
  g.bytes += t.bytes;
  CandidateList& s = sessions_[t.session].candidates;
  t.session_pos = static_cast<uint32_t>(s.entries.size());
  s.entries.push_back(entry);
  s.bytes += t.bytes;
}

void TensorTable::RemoveCandidate(uint32_t slot) {
  Tensor& t = slots_[slot];
  // Swap-with-last removal keeps it O(1); order carries no meaning.
  CandidateList& g = gpus_[t.gpu].candidates;
  const CandidateEntry gl = g.entries.back();
  g.entries[t.gpu_pos] = gl;
  slots_[gl.slot].gpu_pos = t.gpu_pos;
  g.entries.pop_back();
  g.bytes -= t.bytes;
  CandidateList& s = sessions_[t.session].candidates;
  const CandidateEntry sl = s.entries.back();
  s.entries[t.session_pos] = sl;
  slots_[sl.slot].session_pos = t.session_pos;
  s.entries.pop_back();
  s.bytes -= t.bytes;
  t.gpu_pos = t.session_pos = UINT32_MAX;
}

void TensorTable::Stamp(uint32_t slot, int64_t now_ns) {
  ++rank_epoch_;
  Tensor& t = slots_[slot];
  Group& session = sessions_[t.session];
  t.last_access_tick = ++session.clock;
  t.last_access_ns = now_ns;
  if (t.gpu_pos == UINT32_MAX) return;  // not a candidate
  gpus_[t.gpu].candidates.entries[t.gpu_pos].last_access_ns = now_ns;
  session.candidates.entries[t.session_pos].last_access_ns = now_ns;
}

void TensorTable::DeferComponents(bool defer) {
  defer_components_ = defer;
  if (!defer && components_stale_) RebuildComponents();
}

bool TensorTable::StaleRatherThanReform(uint32_t slot) const {
  // A hub re-forms its whole component when it leaves it (an optimizer
  // step's outputs list every parameter's tensors, and several of them
  // leave in a row): rebuilding everything once, at the next read, costs
  // less, where that component holds at least half the members and the
  // members are at least a quarter of the tensors (the rebuild scans every
  // tensor). Elsewhere the hub re-forms only its own component, as before.
  const Tensor& t = slots_[slot];
  if (!components_.Contains(slot) ||
      t.parents.size() + t.children.size() <= kHubNeighbours) {
    return false;
  }
  const size_t members = components_.size();
  const size_t component =
      components_.Members(components_.ComponentOf(slot)).size();
  return 2 * component >= members && 4 * members >= index_.size();
}

void TensorTable::RebuildComponents() const {
  components_ = EvictedComponents{};
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    const Tensor& t = slots_[slot];
    if (t.id != 0 && NeedsRecompute(t.state)) {
      components_.Insert(slot, t.compute_cost_ns);
    }
  }
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    if (!components_.Contains(slot)) continue;
    for (uint32_t p : slots_[slot].parents) {
      if (components_.Contains(p)) components_.Union(slot, p);
    }
  }
  components_stale_ = false;
}

void TensorTable::JoinComponents(uint32_t slot) {
  if (defer_components_ || components_stale_) {
    components_stale_ = true;  // rebuilt whole at the next read
    return;
  }
  components_.Insert(slot, slots_[slot].compute_cost_ns);
  for (uint32_t p : slots_[slot].parents) {
    if (components_.Contains(p)) components_.Union(slot, p);
  }
  for (uint32_t c : slots_[slot].children) {
    if (components_.Contains(c)) components_.Union(slot, c);
  }
}

void TensorTable::LeaveComponents(uint32_t slot) {
  ++rank_epoch_;  // the neighbours' recompute costs may fall
  if (defer_components_ || components_stale_ || StaleRatherThanReform(slot)) {
    components_stale_ = true;
    return;
  }
  components_.Erase(slot, [this](uint32_t s, auto visit) {
    for (uint32_t p : slots_[s].parents) visit(p);
    for (uint32_t c : slots_[s].children) visit(c);
  });
}

void TensorTable::ChangeState(uint32_t slot, TensorState to) {
  Tensor& t = slots_[slot];
  const TensorState from = t.state;
  if (from == to) return;
  Account(t, -1);
  if (from == TensorState::kResident) {
    RemoveCandidate(slot);
    t.flags.host_copy = false;  // whatever comes back is another copy
  }
  if (NeedsRecompute(from) && !NeedsRecompute(to)) LeaveComponents(slot);
  t.state = to;
  if (to == TensorState::kEvicted) {
    t.evicted_from_device = from == TensorState::kResident;
  }
  Account(t, +1);
  if (to == TensorState::kResident) AddCandidate(slot);
  // Freed with no child to need it, a tensor is retired at once (Free):
  // joining the evicted components first would merge its neighbours'
  // components only for its leaving to split them again (a search over
  // them), for every temporary and every activation the backward pass is
  // done with.
  const bool retires = to == TensorState::kFreed && t.live_children == 0;
  if (NeedsRecompute(to) && !NeedsRecompute(from) && !retires) {
    JoinComponents(slot);
  }
}

absl::Status TensorTable::Touch(TensorId id, int64_t now_ns) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  if (!OccupiesDevice(t.state)) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is ", TensorStateName(t.state),
                     ": make it resident before using it"));
  }
  Stamp(*slot, now_ns);
  return absl::OkStatus();
}

absl::Status TensorTable::SetState(TensorId id, TensorState to) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  if (!TransitionAllowed(t.state, to)) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, ": cannot go from ",
                     TensorStateName(t.state), " to ", TensorStateName(to)));
  }
  if (to == TensorState::kEvicted &&
      (t.flags.uncomputable || t.flags.evict_pinned)) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is ",
                     t.flags.uncomputable ? "uncomputable" : "evict-pinned",
                     ": evicting it would lose its bytes"));
  }
  if (to == TensorState::kOffloading && t.flags.offload_pinned) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is offload-pinned"));
  }
  if (t.state == TensorState::kResident && t.lock_count > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is in use by an op (locked)"));
  }
  ChangeState(*slot, to);
  return absl::OkStatus();
}

absl::Status TensorTable::MarkRecomputed(TensorId id, int64_t now_ns) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  if (t.state != TensorState::kEvicted && t.state != TensorState::kOffloaded) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is ", TensorStateName(t.state),
                     ": only evicted or offloaded tensors are recomputed"));
  }
  if (t.flags.uncomputable) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is uncomputable"));
  }
  ChangeState(*slot, TensorState::kResident);
  ++t.recompute_count;
  Stamp(*slot, now_ns);
  return absl::OkStatus();
}

absl::Status TensorTable::CancelRelease(TensorId id) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  const bool cancellable =
      t.state == TensorState::kOffloading ||
      (t.state == TensorState::kEvicted && t.evicted_from_device);
  if (!cancellable) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor ", id, " is ", TensorStateName(t.state),
        t.state == TensorState::kEvicted ? " (its host copy was dropped)" : "",
        ": no release to cancel"));
  }
  ChangeState(*slot, TensorState::kResident);
  return absl::OkStatus();
}

absl::Status TensorTable::Lock(TensorId id) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  if (t.state == TensorState::kFreed) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " was freed"));
  }
  ++t.lock_count;
  return absl::OkStatus();
}

absl::Status TensorTable::Unlock(TensorId id) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  if (t.lock_count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is not locked"));
  }
  --t.lock_count;
  return absl::OkStatus();
}

absl::Status TensorTable::SetAdjacentFreeBytes(TensorId id, int64_t bytes) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", id, ": negative adjacent free bytes"));
  }
  slots_[*slot].adjacent_free_bytes = bytes;
  ++rank_epoch_;
  return absl::OkStatus();
}

absl::Status TensorTable::SetHostCopy(TensorId id, bool copied) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  if (t.state != TensorState::kResident) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is ", TensorStateName(t.state),
                     ": only a resident tensor has a copy made ahead"));
  }
  t.flags.host_copy = copied;
  ++rank_epoch_;
  gpus_[t.gpu].candidates.entries[t.gpu_pos].flags = t.flags;
  sessions_[t.session].candidates.entries[t.session_pos].flags = t.flags;
  return absl::OkStatus();
}

MemoryStats TensorTable::GpuStats(GpuId gpu) const {
  auto it = gpus_.find(gpu);
  return it == gpus_.end() ? MemoryStats{} : it->second.stats;
}

MemoryStats TensorTable::SessionStats(SessionId session) const {
  auto it = sessions_.find(session);
  return it == sessions_.end() ? MemoryStats{} : it->second.stats;
}

MemoryStats TensorTable::ScopeStats(const Scope& scope) const {
  return scope.session ? SessionStats(*scope.session) : GpuStats(scope.gpu);
}

absl::Span<const CandidateEntry> TensorTable::CandidateEntries(
    const Scope& scope) const {
  if (scope.session) {
    auto it = sessions_.find(*scope.session);
    if (it == sessions_.end()) return {};
    return it->second.candidates.entries;
  }
  auto it = gpus_.find(scope.gpu);
  if (it == gpus_.end()) return {};
  return it->second.candidates.entries;
}

std::vector<uint32_t> TensorTable::Candidates(const Scope& scope) const {
  std::vector<uint32_t> slots;
  for (const CandidateEntry& e : CandidateEntries(scope)) {
    slots.push_back(e.slot);
  }
  return slots;
}

int64_t TensorTable::CandidateBytes(const Scope& scope) const {
  if (scope.session) {
    auto it = sessions_.find(*scope.session);
    return it == sessions_.end() ? 0 : it->second.candidates.bytes;
  }
  auto it = gpus_.find(scope.gpu);
  return it == gpus_.end() ? 0 : it->second.candidates.bytes;
}

}  // namespace deltad::policy
