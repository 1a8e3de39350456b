// The Client's byte work on one tensor: offload to host memory, evict,
// reload and recompute, each reported to the daemon as an event. Apart from
// client.cc (the tensors' life cycle and public API).

#include "absl/strings/str_cat.h"
#include "client/client.h"

namespace deltad::client {

using Kind = v1::TensorEvent;

bool Client::OrderedElsewhereLocked(uint64_t id, Origin origin) {
  // A daemon's order for it arrived after the in-process plan chose it: the
  // daemon holds it as releasing, and a release it did not order would make
  // it refuse the batch (and the session be opened anew). The order's own
  // release goes ahead.
  if (origin != Origin::kLocalPlan || !ordered_.contains(id)) return false;
  RefuseLocked(id, origin);
  return true;
}

void Client::RefuseLocked(uint64_t id, Origin origin, Refusal why) {
  if (origin == Origin::kDaemonOrder) {
    ++stats_.orders_refused;
    AddEventLocked(Kind::RELEASE_FAILED, id);
  } else {
    ++stats_.local_refused;
    if (why == Refusal::kNoHost) ++stats_.local_refused_no_host;
    if (why == Refusal::kInUse) ++stats_.local_refused_in_use;
    (void)local_.table().CancelRelease(id);
  }
}

absl::Status Client::Offload(uint64_t id, Origin origin) {
  Record* r;
  {
    std::unique_lock<std::mutex> lock(mu_);
    r = WaitForCopyAheadLocked(lock, id);
    if (r == nullptr) return absl::OkStatus();  // gone meanwhile
    if (OrderedElsewhereLocked(id, origin)) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor ", id, " is in a release the daemon ordered"));
    }
    if (origin != Origin::kLocalPlan &&
        (r->where == Where::kOffloading || r->where == Where::kOffloaded ||
         r->where == Where::kFreed)) {
      return absl::OkStatus();  // done already: the order came twice
    }
    if (r->where != Where::kResident || r->pins > 0 || r->info.offload_pinned) {
      RefuseLocked(id, origin, Refusal::kInUse);
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", id, " cannot be offloaded now (in use or pinned)"));
    }
    if (r->ahead == Record::Ahead::kLanded) {
      // Copied ahead: the device memory goes now, with no copy to wait for.
      r->host = r->ahead_host;
      r->ahead_host = {};
      r->ahead = Record::Ahead::kNone;
      ahead_bytes_ -= r->info.bytes;
      if (origin != Origin::kLocalPlan) {
        (void)local_.table().SetState(id, policy::TensorState::kOffloading);
      }
      ++stats_.offloads_from_copies;
      FinishOffloadLocked(r);
      return absl::OkStatus();
    }
    DropCopyLocked(r);  // queued, never copied: it leaves the device now
    auto host = AllocateHostLocked(r->info.bytes);
    if (!host.ok()) {
      RefuseLocked(id, origin, Refusal::kNoHost);
      return host.status();
    }
    r->host = *host;
    r->where = Where::kOffloading;
    offloading_bytes_ += r->info.bytes;
    if (origin != Origin::kLocalPlan) {
      (void)local_.table().SetState(id, policy::TensorState::kOffloading);
    }
  }
  // The copy runs unlocked: the compute thread goes on, and one that needs
  // this tensor waits on changed_.
  HostArena::ForEachPiece(r->host, [&](char* host, int64_t at, int64_t n) {
    device_->CopyToHost(host, static_cast<char*>(r->device) + at, n);
  });
  std::lock_guard<std::mutex> lock(mu_);
  offloading_bytes_ -= r->info.bytes;
  FinishOffloadLocked(r);
  return absl::OkStatus();
}

void Client::FinishOffloadLocked(Record* r) {
  const uint64_t id = r->info.id;
  device_->Free(r->device, r->info.bytes);
  device_bytes_ -= r->info.bytes;
  r->device = nullptr;
  r->where = Where::kOffloaded;
  (void)local_.table().SetState(id, policy::TensorState::kOffloaded);
  AddEventLocked(Kind::OFFLOADED, id);
  ++stats_.offloads;
  stats_.offloaded_bytes += r->info.bytes;
  changed_.notify_all();
}

absl::Status Client::Evict(uint64_t id, Origin origin) {
  std::unique_lock<std::mutex> lock(mu_);
  Record* r = WaitForCopyAheadLocked(lock, id);
  if (r == nullptr) return absl::OkStatus();
  if (OrderedElsewhereLocked(id, origin)) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " is in a release the daemon ordered"));
  }
  if (origin != Origin::kLocalPlan &&
      (r->where == Where::kEvicted || r->where == Where::kFreed)) {
    return absl::OkStatus();  // done already: the order came twice
  }
  if (r->where != Where::kResident || r->pins > 0 || r->info.evict_pinned ||
      r->info.uncomputable || !r->recompute) {
    RefuseLocked(id, origin,
                 r->where != Where::kResident || r->pins > 0 ? Refusal::kInUse
                                                             : Refusal::kOther);
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id,
                     " cannot be evicted now (in use, pinned, or no "
                     "recompute function)"));
  }
  DropCopyLocked(r);
  device_->Free(r->device, r->info.bytes);
  device_bytes_ -= r->info.bytes;
  r->device = nullptr;
  r->where = Where::kEvicted;
  if (origin != Origin::kLocalPlan) {
    (void)local_.table().SetState(id, policy::TensorState::kEvicted);
  }
  AddEventLocked(Kind::EVICTED, id);
  ++stats_.evictions;
  return absl::OkStatus();
}

absl::Status Client::Reload(uint64_t id, Need need) {
  const bool prefetch = need != Need::kNow;
  // A daemon's prefetch order is answered (RELEASE_FAILED) when declined;
  // a hint is just dropped.
  auto decline = [&] {
    if (need == Need::kPrefetchOrder) RefuseLocked(id, Origin::kDaemonOrder);
  };
  Record* r;
  int64_t bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(id);
    if (it == records_.end()) return absl::OkStatus();
    r = it->second.get();
    bytes = r->info.bytes;
    if (r->where != Where::kOffloaded) {
      // Someone else brought it back (its RELOADED answers a prefetch
      // order too), or it is on its way.
      return absl::OkStatus();
    }
    if (prefetch &&
        (making_room_ > 0 || device_bytes_ + bytes > budget_bytes_)) {
      // A prefetch must not push others out, nor take room an allocation
      // is being made for: it is only a head start.
      decline();
      return absl::OkStatus();
    }
    // Claimed before the allocation, so a second Pin waits on this one;
    // a prefetch reserves its bytes with the check, so that an allocation
    // meanwhile cannot take the same room.
    if (prefetch) {
      ++prefetching_;
      device_bytes_ += bytes;
    }
    r->where = Where::kReloading;
    r->restoring_from = Where::kOffloaded;
    (void)local_.table().SetState(id, policy::TensorState::kReloading);
  }
  auto device = prefetch ? device_->Allocate(bytes) : AllocateDevice(bytes);
  std::unique_lock<std::mutex> lock(mu_);
  if (!device.ok()) {
    r->where = Where::kOffloaded;
    (void)local_.table().SetState(id, policy::TensorState::kOffloaded);
    if (prefetch) {
      decline();
      --prefetching_;
      device_bytes_ -= bytes;
    }
    changed_.notify_all();
    return prefetch ? absl::OkStatus() : device.status();
  }
  lock.unlock();
  HostArena::ForEachPiece(r->host, [&](char* host, int64_t at, int64_t n) {
    device_->CopyToDevice(static_cast<char*>(*device) + at, host, n);
  });
  lock.lock();
  r->device = *device;
  r->where = Where::kResident;
  (void)local_.table().SetState(id, policy::TensorState::kResident);
  AddEventLocked(Kind::RELOADED, id);
  KeepReloadedCopyLocked(r);
  ++stats_.reloads;
  if (prefetch) {
    ++stats_.prefetches;
    --prefetching_;
  }
  stats_.reloaded_bytes += bytes;
  NotePeakLocked();
  changed_.notify_all();
  return absl::OkStatus();
}

absl::Status Client::Recompute(uint64_t id) {
  RecomputeFn fn;
  int64_t bytes;
  bool was_freed;
  Record* r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(id);
    if (it == records_.end()) return absl::OkStatus();  // Pin looks again
    r = it->second.get();
    if (r->where != Where::kEvicted && r->where != Where::kFreed) {
      return absl::OkStatus();  // rebuilt meanwhile; Pin looks again
    }
    if (!r->recompute) {
      return absl::DataLossError(absl::StrCat(
          "tensor ", id, " is gone and has no recompute function"));
    }
    fn = r->recompute;
    bytes = r->info.bytes;
    was_freed = r->where == Where::kFreed;
    // Claimed, like a reload, so that concurrent Pins and Free wait for
    // this one (which also keeps the record alive).
    r->restoring_from = r->where;
    r->where = Where::kReloading;
  }
  auto device = AllocateDevice(bytes);
  absl::Status status = device.status();
  if (device.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    unreported_bytes_ += bytes;
  }
  const int64_t start = NowNs();
  if (device.ok()) status = fn(id, *device);
  const int64_t took = NowNs() - start;
  std::lock_guard<std::mutex> lock(mu_);
  if (device.ok() && !was_freed) unreported_bytes_ -= bytes;
  if (!status.ok()) {
    if (device.ok()) {
      device_->Free(*device, bytes);
      device_bytes_ -= bytes;
      if (was_freed) unreported_bytes_ -= bytes;
    }
    r->where = was_freed ? Where::kFreed : Where::kEvicted;
    changed_.notify_all();
    return absl::Status(status.code(), absl::StrCat("recomputing tensor ", id,
                                                    ": ", status.message()));
  }
  r->device = *device;
  r->where = Where::kResident;
  ++stats_.recomputes;
  stats_.recompute_ns += took;
  if (was_freed) {
    // The framework dropped it; it lives only while a child's recompute
    // pins it (see Unpin). The daemon keeps it as freed.
    r->rebuilt_freed = true;
  } else {
    (void)local_.table().MarkRecomputed(id, NowNs());
    AddEventLocked(Kind::RECOMPUTED, id);
  }
  changed_.notify_all();
  return absl::OkStatus();
}

}  // namespace deltad::client
