#ifndef DELTAD_DAEMON_RELEASE_REPLIES_H_
#define DELTAD_DAEMON_RELEASE_REPLIES_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "daemon/session_id.h"
#include "deltad/v1/memory_manager.pb.h"

namespace deltad::daemon {

// Each session's Release calls, applied once per number
// (ReleaseRequest.release_seq). A process whose call ran past its deadline
// on a busy node cannot know whether the daemon applied its batch and
// ordered its releases; rather than give up the session, it sends the call
// again and gets the first one's answer. Calls of one session run one at
// a time. Thread safe.
class ReleaseReplies {
 public:
  struct Outcome {
    absl::StatusOr<v1::ReleaseResponse> answer;
    // False when nothing was changed (the call may be applied when sent
    // again), e.g. the stream batches it follows had not arrived.
    bool applied = true;
  };

  // The answer to call `seq` of `session`: `apply`'s, or the one it gave
  // before when `seq` is the number of the last call applied. 0: a call
  // not numbered, always applied. A number below the last applied is
  // FAILED_PRECONDITION; an earlier call of the session still running past
  // `deadline` is DEADLINE_EXCEEDED.
  absl::StatusOr<v1::ReleaseResponse> Run(
      SessionId session, uint64_t seq,
      std::chrono::system_clock::time_point deadline,
      const std::function<Outcome()>& apply);

  // The session ended: its last answer goes.
  void Forget(SessionId session);

 private:
  struct Calls {
    std::timed_mutex running;
    uint64_t last_seq = 0;
    absl::StatusOr<v1::ReleaseResponse> last_answer;
  };
  std::mutex mu_;
  std::map<SessionId, std::shared_ptr<Calls>> sessions_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_RELEASE_REPLIES_H_
