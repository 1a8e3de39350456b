#ifndef DELTAD_DAEMON_SESSION_END_LOG_H_
#define DELTAD_DAEMON_SESSION_END_LOG_H_

#include <chrono>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/log_limit.h"
#include "daemon/gpu_policy.h"
#include "daemon/session_lifecycle.h"
#include "daemon/session_registry.h"

namespace deltad::daemon {

// Says that a session ended and why, unless its process closed it: one
// line on stderr naming the session, its process and what it held. When
// many end at once (a node's jobs killed together) at most 10 lines a
// second are written, the next one saying how many were held back. The
// count by reason is the Node's to report (NodeEvents::SessionEnded).
// Thread safe.
class SessionEndLog {
 public:
  // `usage`: what the session held when it ended, if known; `detail`: what
  // ended it (the stream's status), may be empty.
  void Ended(const SessionInfo& session, SessionEnd why,
             absl::string_view detail,
             const absl::StatusOr<SessionUsage>& usage);

 private:
  common::LogLimit limit_{10, std::chrono::seconds(1)};
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SESSION_END_LOG_H_
