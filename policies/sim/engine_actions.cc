#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "policies/sim/engine.h"

namespace deltad::sim::engine_internal {

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
  ahead_bytes_ -= program_.storages[s].bytes;
  if (state_[s] == StorageState::kResident) policy_.OnHostCopyDropped(*this, s);
}

void Engine::ReclaimHost(int64_t bytes) {
  // The copies made last go first: a forward pass reads its oldest
  // tensors last, so their copies are the ones worth keeping.
  while (options_.host_bytes - host_used_ < bytes && !ahead_order_.empty()) {
    const int32_t s = ahead_order_.back();
    ahead_order_.pop_back();
    DropHostCopy(s);  // a no-op for an entry whose copy is gone already
  }
}

void Engine::KeepReloadedCopy(int32_t s) {
  const Storage& st = program_.storages[s];
  const int64_t bytes = st.bytes;
  // What the client keeps: tensors the forward pass made, read only from
  // then on (TensorInfo::copy_ahead), not weights or the backward's.
  if (!options_.keep_reloaded_copies || st.producer < 0 ||
      program_.steps[st.producer].phase != Phase::kForward) {
    host_used_ -= bytes;
    return;
  }
  host_copy_[s] = HostCopy::kLanded;
  ahead_bytes_ += bytes;
  ahead_order_.push_back(s);
}

bool Engine::Offload(int32_t s) {
  const int64_t bytes = program_.storages[s].bytes;
  if (state_[s] != StorageState::kResident || locks_[s] > 0) return false;
  if (const HostCopy copy = host_copy_[s]; copy != HostCopy::kNone) {
    // The copy made ahead becomes the offload's (its host bytes stay).
    host_copy_[s] = HostCopy::kNone;
    ahead_bytes_ -= bytes;
    ++result_.offloads;
    if (copy == HostCopy::kCopying) {
      releasing_ += bytes;  // the copy's end frees the memory
      SetState(s, StorageState::kOffloading);
      return true;
    }
    // On the host already: the memory is free at once.
    allocator_->Free(s);
    ++result_.offloads_from_copies;
    SetState(s, StorageState::kOffloading);
    SetState(s, StorageState::kOffloaded);
    return true;
  }
  if (host_free() < bytes) return false;
  ReclaimHost(bytes);
  YieldCopiesAhead();
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

void Engine::YieldCopiesAhead() {
  // Copies made ahead are issued in chunks behind anything else: a release
  // waits for the chunk under way, and those not started are dropped.
  std::deque<CopyEngine::Transfer>& q = d2h_.queue;
  int64_t free_at = now_;
  bool cut = false;
  while (!q.empty()) {
    const CopyEngine::Transfer tr = q.back();
    const int32_t s = tr.storage;
    if (tr.generation != generation_[s] ||
        host_copy_[s] != HostCopy::kCopying) {
      break;  // a release's or a reload's: it keeps its place
    }
    const int64_t bytes = program_.storages[s].bytes;
    const int64_t start = tr.end_ns - CopyNs(bytes, device_.d2h_bytes_per_s);
    if (start < now_) {
      free_at = std::min(
          tr.end_ns, now_ + CopyNs(kAheadChunkBytes, device_.d2h_bytes_per_s));
    } else {
      result_.d2h_bytes -= bytes;  // never carried
    }
    q.pop_back();
    DropHostCopy(s);
    cut = true;
  }
  if (cut) {
    d2h_.free_at = q.empty() ? free_at : std::max(q.back().end_ns, free_at);
  }
}

bool Engine::CopyAhead(int32_t s) {
  const int64_t bytes = program_.storages[s].bytes;
  // Only room no one holds: a copy ahead never displaces another.
  if (state_[s] != StorageState::kResident ||
      host_copy_[s] != HostCopy::kNone ||
      options_.host_bytes - host_used_ < bytes) {
    return false;
  }
  const int64_t start = std::max(now_, d2h_.free_at);
  d2h_.free_at = start + CopyNs(bytes, device_.d2h_bytes_per_s);
  d2h_.queue.push_back({s, d2h_.free_at, ++generation_[s]});
  host_copy_[s] = HostCopy::kCopying;
  host_used_ += bytes;
  ahead_bytes_ += bytes;
  ahead_order_.push_back(s);
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
      KeepReloadedCopy(s);
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
    // Prefetches still copying in hold memory no policy can release until
    // they land: the next one lands, and is then a candidate.
    if (reloads_in_flight_ > 0 && !h2d_->queue.empty()) {
      StallUntil(h2d_->queue.front().end_ns);
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

void Engine::CancelOffload(int32_t s) {
  ++generation_[s];  // the copy's end is ignored
  releasing_ -= program_.storages[s].bytes;
  host_used_ -= program_.storages[s].bytes;
  SetState(s, StorageState::kResident);
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

}  // namespace deltad::sim::engine_internal
