#ifndef DELTAD_DAEMON_CHUNK_LEDGER_H_
#define DELTAD_DAEMON_CHUNK_LEDGER_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/side_protocol.h"
#include "daemon/backend/device_backend.h"
#include "daemon/session_id.h"

namespace deltad::daemon {

// Which session holds which device chunks: a session's budget is made of
// physical chunks (DeviceBackend::CreateChunk) that its process maps. Grants
// never take a session past its budget; a session returns chunks when its
// budget shrinks, and all of them go back to the backend when it is
// reclaimed. A session can only return its own chunks.
//
// Backend calls (cuMemCreate takes milliseconds) run outside the lock.
// Does not own the backend, which must outlive it. Thread safe.
class ChunkLedger {
 public:
  explicit ChunkLedger(DeviceBackend& backend) : backend_(backend) {}
  ChunkLedger(const ChunkLedger&) = delete;
  ChunkLedger& operator=(const ChunkLedger&) = delete;
  ~ChunkLedger();  // releases every chunk still held

  // A session that may hold chunks on `gpu` (a GPU of the backend) from
  // now on.
  void AddSession(SessionId session, int gpu);

  // New chunks for `session` until it holds at least target_bytes, never
  // past budget_bytes (the most it may hold); none when it holds that much
  // already. Stops early, with what it made, when the GPU is out of
  // memory (the others have not returned theirs yet). NOT_FOUND for a
  // session not added or already released.
  absl::StatusOr<std::vector<common::side::Grant>> Grant(SessionId session,
                                                         int64_t target_bytes,
                                                         int64_t budget_bytes);

  // The process let go of these chunks (unmapped them): back to the
  // backend. NOT_FOUND, and nothing returned, when one of them is not the
  // session's.
  absl::Status Return(SessionId session, absl::Span<const uint64_t> ids);

  // Every chunk of the session goes back; the session can hold no more.
  // Returns the bytes released.
  int64_t ReleaseSession(SessionId session);

  int64_t held_bytes(SessionId session) const;
  // What each session on `gpu` holds, in one look.
  std::vector<std::pair<SessionId, int64_t>> HeldOnGpu(int gpu) const;

 private:
  struct Holder {
    int gpu = 0;
    std::set<uint64_t> chunks;  // all of the GPU's chunk size
  };
  int64_t ChunkBytes(int gpu) const {
    return backend_.gpus()[gpu].chunk_granularity;
  }
  int64_t Held(const Holder& h) const {
    return static_cast<int64_t>(h.chunks.size()) * ChunkBytes(h.gpu);
  }

  DeviceBackend& backend_;
  mutable std::mutex mu_;
  std::map<SessionId, Holder> holders_ ABSL_GUARDED_BY(mu_);
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_CHUNK_LEDGER_H_
