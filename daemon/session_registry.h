#ifndef DELTAD_DAEMON_SESSION_REGISTRY_H_
#define DELTAD_DAEMON_SESSION_REGISTRY_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/session_id.h"

namespace deltad::daemon {

// Who a process is, as the kernel says (SO_PEERCRED on the side socket).
struct PeerIdentity {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  // When the kernel started it (ProcessStartTime): with the pid, the
  // process for good. 0 when unknown.
  uint64_t start_time = 0;
};

struct SessionInfo {
  SessionId id = 0;
  std::string token;  // secret: authorises the session's gRPC calls
  PeerIdentity peer;
  std::string peer_token;  // secret: its process's (RegisterPeer)
  int gpu = 0;
  uint32_t priority = 1;
  std::string label;
};

// The session limit an Open was refused at, for the refusal metrics.
enum class SessionLimit { kNone, kPerGpu, kPerUid };

// Which process owns which session, and the secrets that prove it.
//
// gRPC on a Unix socket does not tell the daemon who is calling, so identity
// flows through the side socket: a process connects there, the daemon reads
// its credentials (SO_PEERCRED) and hands it a peer token over that
// connection only. OpenSession must present a live peer token, which binds
// the session to that process; it returns a session token that authorises
// the session's later calls. When the side-socket connection ends (the
// process exited or died), ForgetPeer reclaims all of its sessions at once.
//
// Tokens are 128 random bits from the kernel, compared in constant time.
// Thread safe.
class SessionRegistry {
 public:
  explicit SessionRegistry(int max_sessions_per_gpu,
                           int max_sessions_per_uid = 1 << 30)
      : max_sessions_per_gpu_(max_sessions_per_gpu),
        max_sessions_per_uid_(max_sessions_per_uid) {}

  // A process connected to the side socket; returns its peer token.
  absl::StatusOr<std::string> RegisterPeer(const PeerIdentity& peer);

  // Opens a session for the process holding `peer_token`. UNAUTHENTICATED
  // for an unknown token; RESOURCE_EXHAUSTED past the per-GPU limit or
  // the per-user one (the peer's uid, on all GPUs);
  // ALREADY_EXISTS when the process already has a session on that GPU.
  absl::StatusOr<SessionInfo> Open(absl::string_view peer_token, int gpu,
                                   uint32_t priority, std::string label,
                                   SessionLimit* refused_at = nullptr);
  // The session a token authorises; UNAUTHENTICATED when none.
  absl::StatusOr<SessionInfo> Authorize(absl::string_view session_token) const;
  // As Authorize, and the session must belong to the process holding
  // `peer_token`: PERMISSION_DENIED when it belongs to another.
  absl::StatusOr<SessionInfo> AuthorizeForPeer(
      absl::string_view session_token, absl::string_view peer_token) const;
  // The process holding a live peer token; UNAUTHENTICATED when none.
  absl::StatusOr<PeerIdentity> PeerOf(absl::string_view peer_token) const;
  // Closes the session a token authorises and returns it.
  absl::StatusOr<SessionInfo> Close(absl::string_view session_token);
  // The process behind a peer token is gone: forgets the token and returns
  // every session it had, for the daemon to reclaim.
  std::vector<SessionInfo> ForgetPeer(absl::string_view peer_token);

  std::vector<SessionInfo> List() const;
  size_t SessionsOnGpu(int gpu) const;
  size_t sessions() const;

 private:
  static absl::StatusOr<std::string> NewToken();
  static absl::Status UnknownPeer();
  // Index of the entry whose key equals `token`, compared in constant time
  // per candidate so the comparison leaks nothing about near misses.
  template <typename Map>
  static typename Map::const_iterator FindToken(const Map& map,
                                                absl::string_view token);

  const int max_sessions_per_gpu_;
  const int max_sessions_per_uid_;
  mutable std::mutex mu_;
  std::map<std::string, PeerIdentity> peers_;    // peer token -> identity
  std::map<std::string, SessionInfo> sessions_;  // session token -> info
  std::map<std::string, std::vector<std::string>> peer_sessions_;
  SessionId next_id_ = 1;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SESSION_REGISTRY_H_
