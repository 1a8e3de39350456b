#ifndef DELTAD_TOOLS_CALL_RETRY_H_
#define DELTAD_TOOLS_CALL_RETRY_H_

#include <functional>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"

namespace deltad::tools {

// deltactl only reads, so a call that failed with UNAVAILABLE can be made
// again. The daemon's gRPC ends a connection with GOAWAY when its memory
// quota runs short (a flood of calls, docs/RELIABILITY.md), and a call on
// that connection then fails with "UNAVAILABLE: GOAWAY received" though the
// daemon is up: 2 of 9 `deltactl status` runs during bench/stream_flood.py's
// flood, 2026-12-02. The channel opens a new connection for the next
// attempt. Against a daemon that is not there the retries cost 0.7 s.
struct RetryPolicy {
  int retries = 3;  // attempts after the first
  absl::Duration first_wait = absl::Milliseconds(100);  // doubled each time
};

// Calls `call(deadline)` until it returns anything but UNAVAILABLE, at most
// 1 + policy.retries times, waiting between attempts; never starts a wait
// that would end past `deadline`. Returns the last status.
inline grpc::Status CallWithRetries(
    absl::Time deadline, const std::function<grpc::Status(absl::Time)>& call,
    RetryPolicy policy = {}, const std::function<absl::Time()>& now = absl::Now,
    const std::function<void(absl::Duration)>& wait = absl::SleepFor) {
  absl::Duration next_wait = policy.first_wait;
  for (int attempt = 0;; ++attempt) {
    grpc::Status status = call(deadline);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        attempt >= policy.retries || now() + next_wait >= deadline) {
      return status;
    }
    wait(next_wait);
    next_wait *= 2;
  }
}

}  // namespace deltad::tools

#endif  // DELTAD_TOOLS_CALL_RETRY_H_
