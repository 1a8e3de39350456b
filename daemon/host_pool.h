#ifndef DELTAD_DAEMON_HOST_POOL_H_
#define DELTAD_DAEMON_HOST_POOL_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"

namespace deltad::daemon {

// One slab as handed to a caller.
struct Slab {
  uint64_t id = 0;  // stable index of the slab in the pool, 0..slabs-1
  // Owned by the pool, borrowed by the caller (to send with SendFds). Valid
  // until the session holding the slab is released or the pool destroyed.
  int fd = -1;
  int64_t bytes = 0;
};

struct HostPoolStats {
  int64_t slab_bytes = 0;
  int64_t total_bytes = 0;    // every slab, retired ones included
  int64_t free_bytes = 0;     // grantable now
  int64_t granted_bytes = 0;  // held by sessions
  int64_t free_slabs = 0;
  int64_t granted_slabs = 0;
  int64_t wiping_slabs = 0;   // being zeroed by ReleaseSession
  int64_t retired_slabs = 0;  // could not be zeroed: never granted again
  int64_t sessions = 0;       // sessions holding at least one slab
};

// Host memory owned by the daemon, sliced into fixed-size slabs that are
// granted to sessions and passed to their processes as file descriptors.
// Clients map the slabs and register (pin) them with CUDA.
//
// Each slab is its own memfd rather than a range of one big segment: a
// descriptor gives access to the whole file behind it, so one segment per
// slab is what lets a slab be passed to one process without exposing the
// slabs of the others. For the same reason a released slab gets a fresh
// memfd: the previous holder may keep its descriptor (or mapping), and must
// see neither the next session's data nor be able to change it. The old file
// is hole-punched before it is closed, which frees its pages at once and
// zeroes them even for a holder that still maps it.
//
// Slabs are sealed against shrinking and growing (F_SEAL_SHRINK,
// F_SEAL_GROW): a client must not be able to shrink a segment that another
// mapper (the daemon, the sim backend) maps, which would raise SIGBUS there,
// nor grow it past its quota.
//
// Pages are allocated when first touched, not at Create.
//
// Thread safe: every method may be called from any thread. A Slab's fd is
// borrowed; the caller must not use it after releasing its session.
class HostPool {
 public:
  // A pool of floor(total_bytes / slab_bytes) slabs of slab_bytes each.
  // INVALID_ARGUMENT unless slab_bytes is a positive multiple of the page
  // size and total_bytes >= slab_bytes. Each slab holds one descriptor, so
  // the pool needs that many below RLIMIT_NOFILE.
  static absl::StatusOr<std::unique_ptr<HostPool>> Create(int64_t total_bytes,
                                                          int64_t slab_bytes);

  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;
  ~HostPool();  // closes every slab's descriptor

  // Raises what `session` holds to floor(quota_bytes / slab_bytes) whole
  // slabs, never more than its quota, and returns the slabs newly granted
  // (empty when it already holds that many; a smaller quota takes nothing
  // back). All or nothing: RESOURCE_EXHAUSTED ("host pool has N bytes free,
  // asked M") when too few slabs are free. INVALID_ARGUMENT when the quota is
  // smaller than one slab.
  absl::StatusOr<std::vector<Slab>> Grant(uint64_t session,
                                          int64_t quota_bytes);

  // Returns every slab of `session` to the pool, zeroed, each with a new
  // descriptor. A session holding nothing is fine (reclaim may run twice).
  // INTERNAL when a slab could not be zeroed: it is retired, never granted
  // again; the others are returned all the same.
  absl::Status ReleaseSession(uint64_t session);

  HostPoolStats Stats() const;
  // The slabs `session` holds, by id; empty for an unknown session.
  std::vector<Slab> SlabsOf(uint64_t session) const;

  // As SlabsOf, each with a duplicate descriptor made under the pool's lock.
  // INTERNAL when a descriptor cannot be duplicated (out of descriptors).
  // (common::side::Grant: unlike Slab::fd, such a descriptor stays valid
  // and names the same file even if the session releases the slab.)
  absl::StatusOr<std::vector<common::side::Grant>> DuplicateSlabsOf(
      uint64_t session) const;

  int64_t slab_bytes() const { return slab_bytes_; }

 private:
  enum class SlabState { kFree, kGranted, kWiping, kRetired };
  struct Entry {
    common::UniqueFd fd;
    SlabState state = SlabState::kFree;
    uint64_t session = 0;  // meaningful while kGranted
  };

  explicit HostPool(int64_t slab_bytes) : slab_bytes_(slab_bytes) {}
  // A sealed memfd of slab_bytes_ for slab `id`.
  static absl::StatusOr<common::UniqueFd> NewSegment(uint64_t id,
                                                     int64_t bytes);
  Slab SlabAt(uint64_t id) const;  // mu_ held

  const int64_t slab_bytes_;
  // std::mutex, as everywhere in the project: Debian's Abseil is not built
  // with ThreadSanitizer, which then cannot see absl::Mutex.
  mutable std::mutex mu_;
  // Indexed by slab id; sized once at Create.
  std::vector<Entry> slabs_ ABSL_GUARDED_BY(mu_);
  // Free slab ids; popped from the back, so recently freed slabs go first.
  std::vector<uint64_t> free_ ABSL_GUARDED_BY(mu_);
  // Slab ids held by each session, in grant order.
  absl::flat_hash_map<uint64_t, std::vector<uint64_t>> by_session_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_HOST_POOL_H_
