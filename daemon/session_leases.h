#ifndef DELTAD_DAEMON_SESSION_LEASES_H_
#define DELTAD_DAEMON_SESSION_LEASES_H_

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "daemon/session_id.h"

namespace deltad::daemon {

struct LeaseOptions {
  // A session not heard from for this long is unresponsive.
  int64_t lease_ns = int64_t{5} * 1000 * 1000 * 1000;
  // One unresponsive this long is to be ended; 0: never.
  int64_t end_after_ns = 0;
  // The longest gap between two ticks that counts in full. A longer one is
  // the daemon itself not running (stopped, starved, suspended): the
  // processes were not heard because nobody listened, so only this much
  // of it counts.
  int64_t max_tick_credit_ns = int64_t{500} * 1000 * 1000;
};

// Which sessions still answer. A session whose process heartbeats holds a
// lease from when its stream opens; anything heard from it renews it. Time
// is the daemon's running time, advanced by Tick, so that a stall of the
// daemon does not expire every lease at once when it resumes.
//
// Heard is on every stream message's path: one lock and one map lookup.
// Time is passed in (steady clock nanoseconds), so tests need no sleeps.
// Thread safe.
class SessionLeases {
 public:
  explicit SessionLeases(LeaseOptions options) : options_(options) {}

  // The session holds a lease from `now_ns` on.
  void Add(SessionId session, int64_t now_ns);
  // Its stream ended: no lease, and no change is reported for it any more.
  void Remove(SessionId session);
  // Something came from the session's process.
  void Heard(SessionId session);
  // The daemon is working on what the session sent (true) or done with it
  // (false, which counts as heard): time the daemon takes, waiting for a
  // GPU's lock under load, is not the process's silence, and what it sent
  // meanwhile waits unread behind it.
  void Busy(SessionId session, bool busy);

  struct Change {
    enum Kind {
      kUnresponsive,  // silent past its lease
      kAnswered,      // heard again after it was marked unresponsive
      kEnd,           // unresponsive for LeaseOptions::end_after_ns
    };
    SessionId session = 0;
    Kind kind = kUnresponsive;
    int64_t silent_ns = 0;  // running time since it was last heard
  };
  // Advances the running time to `now_ns` and returns what changed since
  // the last tick, in session order. kEnd comes once per silence.
  // `stopped` says whether a session's process is stopped (SIGSTOP, a
  // debugger): such a one is unresponsive past its lease, one that looks
  // alive only past three (on a loaded node a process that runs can go
  // seconds without a turn). Called for silent sessions only; null: none is.
  std::vector<Change> Tick(
      int64_t now_ns, const std::function<bool(SessionId)>& stopped = nullptr);

  // Running time the session has not been heard for, when it is marked
  // unresponsive; 0 otherwise (or when it holds no lease).
  int64_t UnresponsiveFor(SessionId session) const;
  const LeaseOptions& options() const { return options_; }

 private:
  struct Lease {
    int64_t heard_at = 0;  // running time
    bool heard = false;    // since the last tick
    bool busy = false;     // the daemon is working on its message
    bool unresponsive = false;
    bool end_reported = false;
  };

  const LeaseOptions options_;
  mutable std::mutex mu_;
  int64_t running_ns_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_tick_ns_ ABSL_GUARDED_BY(mu_) = -1;  // -1: no tick yet
  std::map<SessionId, Lease> leases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SESSION_LEASES_H_
