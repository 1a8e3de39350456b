#include "daemon/release_replies.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace deltad::daemon {

absl::StatusOr<v1::ReleaseResponse> ReleaseReplies::Run(
    SessionId session, uint64_t seq,
    std::chrono::system_clock::time_point deadline,
    const std::function<Outcome()>& apply) {
  std::shared_ptr<Calls> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = sessions_[session];
    if (slot == nullptr) slot = std::make_shared<Calls>();
    calls = slot;
  }
  std::unique_lock<std::timed_mutex> running(calls->running, std::defer_lock);
  if (!running.try_lock_until(deadline)) {
    return absl::DeadlineExceededError(
        "an earlier Release call of this session is still being answered");
  }
  if (seq != 0 && seq == calls->last_seq) return calls->last_answer;
  if (seq != 0 && seq < calls->last_seq) {
    return absl::FailedPreconditionError(
        absl::StrCat("release_seq ", seq, " is below ", calls->last_seq,
                     ", the number of this session's last call applied"));
  }
  Outcome outcome = apply();
  if (seq != 0 && outcome.applied) {
    calls->last_seq = seq;
    calls->last_answer = outcome.answer;
  }
  return std::move(outcome.answer);
}

void ReleaseReplies::Forget(SessionId session) {
  std::lock_guard<std::mutex> lock(mu_);
  sessions_.erase(session);
}

}  // namespace deltad::daemon
