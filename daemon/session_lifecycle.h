#ifndef DELTAD_DAEMON_SESSION_LIFECYCLE_H_
#define DELTAD_DAEMON_SESSION_LIFECYCLE_H_

// What can become of an open session. The node reports these (NodeEvents)
// and the metrics label them (Metrics): here so that neither depends on the
// other for them.

namespace deltad::daemon {

// Why a session ended, label `reason` of deltad_sessions_ended_total.
enum class SessionEnd {
  kClosed,        // the process ended its stream: reason="closed"
  kStreamBroken,  // the stream broke or was cancelled first: "stream_broken"
  kProcessGone,   // its side connection closed first (exit, crash, a link
                  // the process dropped): "process_gone"
};

// What happened to a session's lease, label `event` of
// deltad_unresponsive_total.
enum class LeaseEvent {
  kMarked,    // silent past its lease: "marked"
  kAnswered,  // heard again after that: "answered"
  kEnded,     // its process sent SIGKILL (lease.end_unresponsive_after_ms):
              // "ended"
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SESSION_LIFECYCLE_H_
