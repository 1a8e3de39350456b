// The device chunks behind a chunk-backed device: fetched from the daemon
// up to the budget (or made in-process without one), waited for when other
// sessions still owe them, returned when the budget comes down.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"

namespace deltad::client {

bool Client::WaitForOwedChunks(const std::shared_ptr<DaemonLink>& link,
                               int64_t budget, int64_t bytes,
                               int64_t deadline_ns) {
  const int64_t owed = InWholeChunks(*link, budget);
  for (int i = 1; NowNs() < deadline_ns; ++i) {
    {
      // A session that ended (the daemon died, or this process reconnected
      // meanwhile) owes nothing: its link would fail every call until the
      // deadline, and every allocation would wait that long.
      std::lock_guard<std::mutex> lock(mu_);
      if (!stats_.connected || link_ != link) return false;
    }
    // Owed only while both counts are short: the device's (the budget
    // covers every chunk this process maps, those of an earlier session
    // that its tensors still use included) and the daemon's (which grants
    // up to the budget in its session's chunks, and knows nothing of an
    // earlier session's). Either one full, no chunk will come.
    const int64_t held = device_->chunk_bytes_held();
    if (held >= owed || SessionChunkBytes(*link) >= owed) return false;
    // The sessions holding them release only when told: an idle one, or
    // one whose tensors were pinned when it was last told, hears it again.
    (void)MakeRoom(bytes);
    if (!SyncChunks(link, owed).ok()) return false;
    if (device_->chunk_bytes_held() > held) return true;
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(5 * i, 100)));
  }
  return false;
}

int64_t Client::SessionChunkBytes(const DaemonLink& link) {
  std::lock_guard<std::mutex> lock(chunk_mu_);
  if (&link != chunk_link_) return 0;
  return static_cast<int64_t>(daemon_chunk_.size()) *
         link.session().chunk_bytes();
}

int64_t Client::InWholeChunks(const DaemonLink& link, int64_t budget) {
  // Asking for a partial chunk's worth would round up past the budget.
  const int64_t chunk = link.session().chunk_bytes();
  return chunk > 0 ? budget / chunk * chunk : budget;
}

absl::Status Client::SyncChunks(const std::shared_ptr<DaemonLink>& link,
                                int64_t want) {
  if (device_->chunk_backend().empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(chunk_mu_);
  {
    // A link taken before the session changed (the daemon restarted while
    // an allocation waited) would switch the bookkeeping below back to it,
    // and the current session's chunks, in use, would be forgotten: never
    // given back, and counted by the daemon against every new grant.
    std::lock_guard<std::mutex> state(mu_);
    const DaemonLink* current =
        connecting_ != nullptr ? connecting_
                               : (stats_.connected ? link_.get() : nullptr);
    if (link.get() != current) {
      return absl::FailedPreconditionError(
          "the daemon session changed meanwhile");
    }
  }
  if (link.get() != chunk_link_) {
    // Chunks of an earlier session that tensors still use stay mapped
    // (their memory lives while mapped) but are ours alone now: the new
    // session never granted them. The free ones are dropped, so that
    // memory the daemon no longer counts is not kept beside the new grant.
    (void)device_->ShrinkChunksTo(0);
    daemon_chunk_.clear();
    chunk_link_ = link.get();
  }
  if (link == nullptr) {
    if (device_->chunk_bytes_held() >= want) return absl::OkStatus();
    return device_->AddLocalChunks(want);
  }
  const v1::OpenSessionResponse& session = link->session();
  if (session.backend() != device_->chunk_backend()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "deltad's device memory is ", session.backend(), " chunks, which a ",
        device_->name(), " device cannot map"));
  }
  if (const std::string uuid = device_->gpu_uuid();
      !uuid.empty() && uuid != session.gpu_uuid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("deltad's GPU ", link->gpu(), " is ", session.gpu_uuid(),
                     " but this process's device is ", uuid,
                     " (check CUDA_VISIBLE_DEVICES)"));
  }
  if (device_->chunk_bytes_held() < want) {
    auto chunks = link->FetchChunks(want);
    if (!chunks.ok()) return chunks.status();
    std::vector<uint64_t> unusable;
    absl::Status status;
    for (const common::side::Grant& c : *chunks) {
      const uint64_t key = next_chunk_key_++;
      absl::Status s =
          status.ok() ? device_->AddChunk(key, c.fd.get(), c.bytes) : status;
      if (s.ok()) {
        daemon_chunk_[key] = c.id;
      } else {
        status = s;
        unusable.push_back(c.id);
      }
    }
    if (!unusable.empty()) (void)link->ReturnChunks(unusable);
    if (!status.ok()) return status;
  }
  // Down to the whole chunks that cover `want`, never below it.
  const int64_t chunk = std::max<int64_t>(1, session.chunk_bytes());
  const int64_t keep = (want + chunk - 1) / chunk * chunk;
  if (device_->chunk_bytes_held() > keep) return ShrinkChunksTo(*link, keep);
  return absl::OkStatus();
}

absl::Status Client::ShrinkChunksTo(DaemonLink& link, int64_t keep) {
  std::vector<uint64_t> ids;
  for (uint64_t key : device_->ShrinkChunksTo(keep)) {
    auto it = daemon_chunk_.find(key);
    if (it == daemon_chunk_.end()) continue;
    ids.push_back(it->second);
    daemon_chunk_.erase(it);
  }
  // Chunks of an earlier session are unmapped, not returned: that session
  // never granted them to this one.
  if (ids.empty() || &link != chunk_link_) return absl::OkStatus();
  return link.ReturnChunks(ids);
}

}  // namespace deltad::client
