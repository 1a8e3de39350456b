// The Client's copies ahead of need: forward activations copied to host
// memory while the executor idles, or kept from the reload that brought
// them back, so that the release that comes for one of them later frees its
// device memory at once, waiting for no copy (the simulator's `delta` does
// the same; `delta-nocopy` measures it without).
// Apart from client_transfers.cc (the releases themselves).

#include <algorithm>
#include <deque>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "client/client.h"

namespace deltad::client {

using Kind = v1::TensorEvent;

namespace {
// How far the executor looks past tensors still pinned by their ops for one
// it can copy: the oldest are the ones the backward pass reads last.
constexpr int kMaxScanned = 64;
constexpr size_t kMaxQueued = 65536;
// Copies start once the process holds this much of its budget: where the
// daemon starts releasing ahead (its high watermark, policy::Watermarks).
constexpr double kCopyAheadFrom = 0.75;
}  // namespace

void Client::QueueCopyAheadLocked(uint64_t id) {
  // An executor never idle (orders back to back) copies nothing: the queue
  // keeps the newest, so that it stays bounded.
  while (ahead_queue_.size() >= kMaxQueued) {
    auto it = records_.find(ahead_queue_.front());
    if (it != records_.end() && it->second->ahead == Record::Ahead::kQueued) {
      it->second->ahead = Record::Ahead::kNone;
    }
    ahead_queue_.pop_front();
  }
  ahead_queue_.push_back(id);
}

void Client::CopyAheadWhileIdle() {
  if (!options_.copy_ahead) return;
  std::unique_lock<std::mutex> lock(mu_);
  ahead_ready_ = false;
  // Idle: no order waits for the executor, and no offload of the training
  // thread's uses the link (a copy ahead would slow the one it waits for).
  // And only in a process that has had to release (training repeats
  // itself: it will again) or comes near its budget: one far below it that
  // never released will likely release nothing, and its copies would only
  // cost link time and host memory. Not "near the budget" alone: releases
  // bring a process down to the daemon's low watermark, and copies are
  // wanted most there.
  while (!stopping_ && jobs_.empty() && offloading_bytes_ == 0 &&
         making_room_ == 0 &&
         (stats_.offloads + stats_.evictions > 0 ||
          device_bytes_ >=
              static_cast<int64_t>(kCopyAheadFrom *
                                   static_cast<double>(budget_bytes_)))) {
    Record* r = nullptr;
    auto found = ahead_queue_.end();
    int scanned = 0;
    for (auto it = ahead_queue_.begin();
         it != ahead_queue_.end() && scanned < kMaxScanned;) {
      auto rec = records_.find(*it);
      if (rec == records_.end() ||
          rec->second->ahead != Record::Ahead::kQueued ||
          rec->second->where != Where::kResident) {
        it = ahead_queue_.erase(it);  // gone, released, or copied already
        continue;
      }
      ++scanned;
      // Still being written by its op, or the daemon ordered it released.
      if (rec->second->pins > 0 || ordered_.contains(*it)) {
        ++it;
        continue;
      }
      r = rec->second.get();
      found = it;
      break;
    }
    if (r == nullptr) return;
    // Only room already mapped: a copy ahead never makes the process take
    // more host memory than its offloads would. None now (no offload has
    // mapped any yet, or offloads fill it): the tensor stays first in line
    // for when there is.
    auto host = arena_.Allocate(r->info.bytes, /*grow=*/false);
    if (!host.ok()) return;
    ahead_queue_.erase(found);
    const int64_t bytes = r->info.bytes;
    r->ahead = Record::Ahead::kCopying;
    r->ahead_host = *host;
    ahead_bytes_ += bytes;
    // Unlocked, as an offload's copy: whatever would free the device bytes
    // (Free, Evict, Offload) waits for it (WaitForCopyAheadLocked).
    lock.unlock();
    HostArena::ForEachPiece(
        r->ahead_host, [&](char* to, int64_t at, int64_t n) {
          device_->CopyToHost(to, static_cast<char*>(r->device) + at, n);
        });
    lock.lock();
    // The in-process plan may hold it as releasing meanwhile: its offload
    // then takes the copy without the mark.
    LandCopyLocked(r);
    ++stats_.copies_ahead;
    stats_.copied_ahead_bytes += bytes;
    changed_.notify_all();
  }
}

Client::Record* Client::WaitForCopyAheadLocked(
    std::unique_lock<std::mutex>& lock, uint64_t id) {
  Record* r = nullptr;
  changed_.wait(lock, [&] {
    auto it = records_.find(id);
    r = it == records_.end() ? nullptr : it->second.get();
    return r == nullptr || r->ahead != Record::Ahead::kCopying;
  });
  return r;
}

void Client::LandCopyLocked(Record* r) {
  const uint64_t id = r->info.id;
  r->ahead = Record::Ahead::kLanded;
  (void)local_.table().SetHostCopy(id, true);
  AddEventLocked(Kind::HOST_COPIED, id);
  ahead_landed_.push_back(id);
  if (ahead_landed_.size() < landed_compact_at_) return;
  // A copy that went with its tensor (offloaded, evicted, freed) leaves its
  // entry behind until room is wanted, and a long run with room to spare
  // would keep them all: those of copies gone are dropped here, and of a
  // tensor listed again since, all but its last landing; the list is then
  // let grow to twice what is left.
  absl::flat_hash_set<uint64_t> seen;
  std::deque<uint64_t> kept;
  for (auto at = ahead_landed_.rbegin(); at != ahead_landed_.rend(); ++at) {
    auto it = records_.find(*at);
    if (it != records_.end() && it->second->ahead == Record::Ahead::kLanded &&
        seen.insert(*at).second) {
      kept.push_front(*at);
    }
  }
  ahead_landed_ = std::move(kept);
  landed_compact_at_ = std::max(kMinLandedCompactAt, 2 * ahead_landed_.size());
}

void Client::KeepReloadedCopyLocked(Record* r) {
  if (!options_.copy_ahead || !r->info.copy_ahead || r->info.offload_pinned) {
    arena_.Free(r->host);
    r->host = {};
    return;
  }
  // Read only from now on (TensorInfo::copy_ahead): the bytes it came back
  // from stay a copy made ahead, so that a release before its use (a
  // prefetch that came too early) waits for no copy. Its host room goes,
  // as any such copy's, to an offload that needs it.
  r->ahead_host = r->host;
  r->host = {};
  ahead_bytes_ += r->info.bytes;
  LandCopyLocked(r);
  ++stats_.copies_kept;
}

void Client::DropCopyLocked(Record* r) {
  if (r->ahead == Record::Ahead::kLanded) {
    arena_.Free(r->ahead_host);
    r->ahead_host = {};
    ahead_bytes_ -= r->info.bytes;
  }
  // kCopying is the executor's to finish; callers wait for it first.
  if (r->ahead != Record::Ahead::kCopying) r->ahead = Record::Ahead::kNone;
}

bool Client::DropOldestCopyLocked() {
  while (!ahead_landed_.empty()) {
    const uint64_t id = ahead_landed_.front();
    ahead_landed_.pop_front();
    auto it = records_.find(id);
    if (it == records_.end() || it->second->ahead != Record::Ahead::kLanded)
      continue;
    DropCopyLocked(it->second.get());
    (void)local_.table().SetHostCopy(id, false);
    AddEventLocked(Kind::HOST_COPY_DROPPED, id);
    ++stats_.copies_ahead_dropped;
    return true;
  }
  return false;
}

absl::StatusOr<HostArena::Block> Client::AllocateHostLocked(int64_t bytes) {
  auto host = arena_.Allocate(bytes);
  while (!host.ok() && DropOldestCopyLocked()) host = arena_.Allocate(bytes);
  return host;
}

int64_t Client::HostAvailableLocked() const {
  return arena_.available_bytes() + ahead_bytes_;
}

}  // namespace deltad::client
