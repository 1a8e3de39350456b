// How tensors leave a TensorTable: freed by the framework (retired once no
// child may need them for a recompute), or with their session; and how the
// table then gives its memory back.

#include <algorithm>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "policies/huge_page_allocator.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

absl::Status TensorTable::Free(TensorId id) {
  auto slot = SlotFor(id);
  if (!slot.ok()) return slot.status();
  Tensor& t = slots_[*slot];
  if (t.state == TensorState::kFreed) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " was already freed"));
  }
  t.lock_count = 0;
  ChangeState(*slot, TensorState::kFreed);
  MaybeRetire(*slot);
  return absl::OkStatus();
}

void TensorTable::MaybeRetire(uint32_t slot) {
  const Tensor& first = slots_[slot];
  if (first.state != TensorState::kFreed || first.live_children != 0) return;
  // Iterative: retiring a child can make freed ancestors retirable in turn.
  absl::InlinedVector<uint32_t, 8> work{slot};
  while (!work.empty()) {
    const uint32_t s = work.back();
    work.pop_back();
    Tensor& t = slots_[s];
    if (t.state != TensorState::kFreed || t.live_children != 0) continue;
    for (uint32_t p : t.parents) {
      Tensor& parent = slots_[p];
      auto& c = parent.children;
      c.erase(std::find(c.begin(), c.end(), s));
      if (--parent.live_children == 0) work.push_back(p);
    }
    Retire(s);
  }
}

void TensorTable::Retire(uint32_t slot) {
  LeaveComponents(slot);
  // A freed tensor is no longer counted; nothing left to account.
  ReleaseSlot(slot);
}

void TensorTable::ReleaseSlot(uint32_t slot) {
  ForgetSlot(slot);
  free_slots_.insert(slot);
  CutFreeTail();
}

void TensorTable::ForgetSlot(uint32_t slot) {
  Tensor& t = slots_[slot];
  if (t.stable_key != 0) {
    auto it = by_key_.find(std::make_pair(t.session, t.stable_key));
    if (it != by_key_.end() && it->second == slot) by_key_.erase(it);
  }
  index_.erase(t.id);
  t.Reset();
}

void TensorTable::RemoveSession(SessionId session) {
  ++rank_epoch_;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    Tensor& t = slots_[slot];
    if (t.id == 0 || t.session != session) continue;
    // Every neighbour goes too, so connectivity no longer matters: each
    // member leaves its component as a leaf would, in O(1).
    if (defer_components_ || components_stale_) {
      components_stale_ = true;
    } else {
      components_.Erase(slot, [](uint32_t, auto) {});
    }
    Account(t, -1);
    if (t.state == TensorState::kResident) RemoveCandidate(slot);
    ForgetSlot(slot);
    free_slots_.insert(slot);
  }
  CutFreeTail();
  sessions_.erase(session);
  session_gpu_.erase(session);
  GiveBackMemory();
}

void TensorTable::CutFreeTail() {
  while (!slots_.empty() &&
         free_slots_.contains(static_cast<uint32_t>(slots_.size() - 1))) {
    free_slots_.erase(static_cast<uint32_t>(slots_.size() - 1));
    slots_.pop_back();
  }
}

void TensorTable::GiveBackMemory() {
  DiscardUnusedCapacity(slots_);
  for (auto& [gpu, group] : gpus_) {
    DiscardUnusedCapacity(group.candidates.entries);
  }
  // Hash maps never shrink by themselves; a quarter full is the point
  // where rebuilding one (O(size)) is worth its memory.
  constexpr size_t kMinCapacity = 4096;
  auto shrink = [](auto& map) {
    if (map.capacity() > kMinCapacity && map.size() * 4 < map.capacity()) {
      map.rehash(0);
    }
  };
  shrink(index_);
  shrink(by_key_);
}

}  // namespace deltad::policy
