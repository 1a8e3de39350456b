#ifndef DELTAD_CLIENT_SESSION_KEEPER_H_
#define DELTAD_CLIENT_SESSION_KEEPER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/log_limit.h"

namespace deltad::client {

// Keeps a process attached to deltad, on a thread of its own so that the
// training never waits for it. A session that ends without the process
// closing it (its stream broke, a call failed so that the daemon's view of
// the tensors is unknown, the daemon refused a batch) is ended on both
// sides, then a new one is opened and told everything the process holds;
// meanwhile the process decides alone. Attempts back off from
// `first_retry` to `max_retry` (with some jitter, so that the processes of
// a node do not all knock at once when their daemon comes back), and start
// again at once after a loss: most losses are a restart. Each loss is
// logged and counted; failed attempts are logged a few times a minute.
//
// The keeper knows nothing of sessions itself: the hooks do the work, and
// run on its thread only, never under its lock. Thread safe.
class SessionKeeper {
 public:
  struct Hooks {
    // Ends the lost session on both sides. False when it must stay open
    // for now (it still holds bytes the process needs); tried again later,
    // and no new session is opened until it succeeds.
    std::function<bool()> end_lost;
    // Opens a new session and reports the process's tensors to it; on
    // success, a description for the log ("session 7, 12 tensors").
    std::function<absl::StatusOr<std::string>()> attach;
    // Called every Options::check_every while attached: finds a session
    // that is lost without its stream saying so (see Client::CheckLink).
    std::function<void()> check;
  };
  struct Options {
    std::chrono::milliseconds first_retry{1000};
    std::chrono::milliseconds max_retry{8000};
    // False: a lost session is still ended, but no new one is opened.
    bool reattach = true;
    std::chrono::milliseconds check_every{250};
  };
  struct Stats {
    int64_t sessions_lost = 0;
    int64_t attach_failures = 0;
  };

  SessionKeeper(Options options, Hooks hooks);
  SessionKeeper(const SessionKeeper&) = delete;
  SessionKeeper& operator=(const SessionKeeper&) = delete;
  ~SessionKeeper();  // Stop()

  // Starts the thread. `first` is how the process's own first attempt
  // went: when it failed, the keeper says so and keeps trying.
  void Start(const absl::Status& first);
  // The current session ended without the process closing it. Returns at
  // once; the thread does the rest.
  void Lost(const std::string& why);
  // Stops the thread, waiting for an attempt under way. Idempotent.
  void Stop();

  Stats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  void Run();
  Clock::duration NextDelayLocked();

  const Options options_;
  const Hooks hooks_;
  common::LogLimit lost_log_{5, std::chrono::seconds(60)};
  common::LogLimit retry_log_{1, std::chrono::seconds(30)};

  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool attached_ = false;
  bool end_pending_ = false;  // a lost session to end before attaching
  // Counts Lost calls, so that an attempt that raced one does not undo it.
  uint64_t losses_ = 0;
  Clock::time_point next_try_{};
  Clock::duration delay_{};  // the wait after the next failure
  Clock::time_point detached_since_{};
  int attempts_ = 0;  // since the last session ended
  Stats stats_;
  std::minstd_rand jitter_;
  std::thread thread_;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_SESSION_KEEPER_H_
