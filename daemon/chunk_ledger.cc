#include "daemon/chunk_ledger.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::daemon {

ChunkLedger::~ChunkLedger() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [session, holder] : holders_) {
    for (uint64_t id : holder.chunks) (void)backend_.ReleaseChunk(id);
  }
}

void ChunkLedger::AddSession(SessionId session, int gpu) {
  std::lock_guard<std::mutex> lock(mu_);
  holders_[session].gpu = gpu;
}

absl::StatusOr<std::vector<common::side::Grant>> ChunkLedger::Grant(
    SessionId session, int64_t target_bytes, int64_t budget_bytes) {
  int gpu;
  int64_t held = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = holders_.find(session);
    if (it == holders_.end()) {
      return absl::NotFoundError(
          absl::StrCat("session ", session, " holds no chunks any more"));
    }
    gpu = it->second.gpu;
    held = Held(it->second);
  }
  const int64_t chunk = ChunkBytes(gpu);
  std::vector<common::side::Grant> out;
  // Requests for one session come one at a time (the process's side
  // connection is served by one thread), so `held` stays true meanwhile.
  while (held < target_bytes && held + chunk <= budget_bytes) {
    auto made = backend_.CreateChunk(gpu, chunk);
    if (!made.ok()) {
      if (absl::IsResourceExhausted(made.status())) break;
      for (const common::side::Grant& c : out)
        (void)backend_.ReleaseChunk(c.id);
      return made.status();
    }
    common::side::Grant granted;
    granted.id = made->id;
    granted.bytes = made->bytes;
    granted.fd.reset(fcntl(made->fd, F_DUPFD_CLOEXEC, 0));
    if (!granted.fd.valid()) {
      const int error = errno;
      (void)backend_.ReleaseChunk(made->id);
      for (const common::side::Grant& c : out)
        (void)backend_.ReleaseChunk(c.id);
      return absl::ErrnoToStatus(error, "duplicating a chunk's descriptor");
    }
    held += made->bytes;
    out.push_back(std::move(granted));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = holders_.find(session);
  if (it == holders_.end()) {
    // Reclaimed while the chunks were being made: they go straight back.
    for (const common::side::Grant& c : out) (void)backend_.ReleaseChunk(c.id);
    return absl::NotFoundError(
        absl::StrCat("session ", session, " was closed during its grant"));
  }
  for (const common::side::Grant& c : out) {
    it->second.chunks.insert(c.id);
  }
  return out;
}

absl::Status ChunkLedger::Return(SessionId session,
                                 absl::Span<const uint64_t> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = holders_.find(session);
  if (it == holders_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " holds no chunks"));
  }
  auto& chunks = it->second.chunks;
  for (uint64_t id : ids) {
    if (!chunks.contains(id)) {
      return absl::NotFoundError(absl::StrCat("chunk ", id,
                                              " is not held by session ",
                                              session, "; none returned"));
    }
  }
  for (uint64_t id : ids) {
    // Named twice in one list: released once.
    if (chunks.erase(id) == 1) (void)backend_.ReleaseChunk(id);
  }
  return absl::OkStatus();
}

int64_t ChunkLedger::ReleaseSession(SessionId session) {
  Holder holder;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = holders_.find(session);
    if (it == holders_.end()) return 0;
    holder = std::move(it->second);
    holders_.erase(it);
  }
  for (uint64_t id : holder.chunks) (void)backend_.ReleaseChunk(id);
  return Held(holder);
}

int64_t ChunkLedger::held_bytes(SessionId session) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = holders_.find(session);
  return it == holders_.end() ? 0 : Held(it->second);
}

std::vector<std::pair<SessionId, int64_t>> ChunkLedger::HeldOnGpu(
    int gpu) const {
  std::vector<std::pair<SessionId, int64_t>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [session, holder] : holders_) {
    if (holder.gpu == gpu) out.emplace_back(session, Held(holder));
  }
  return out;
}

}  // namespace deltad::daemon
