#ifndef DELTAD_COMMON_LOG_LIMIT_H_
#define DELTAD_COMMON_LOG_LIMIT_H_

#include <chrono>
#include <cstdint>
#include <mutex>

namespace deltad::common {

// Lets a repeating log line through at most `burst` times per `window`, and
// says how many were held back meanwhile, so that a fault that repeats
// (every session of a node lost at once, a client retrying a daemon that is
// down) neither floods the log nor goes silent. Thread safe.
class LogLimit {
 public:
  using Clock = std::chrono::steady_clock;

  LogLimit(int burst, Clock::duration window)
      : burst_(burst), window_(window) {}

  // True when a line may be written now; `held_back` is then set to how
  // many were refused since the last one let through.
  bool Allow(int64_t* held_back) { return AllowAt(Clock::now(), held_back); }
  // As Allow, at `now` (for tests).
  bool AllowAt(Clock::time_point now, int64_t* held_back);

 private:
  const int burst_;
  const Clock::duration window_;
  std::mutex mu_;
  Clock::time_point window_start_{};
  int in_window_ = 0;
  int64_t held_back_ = 0;
};

}  // namespace deltad::common

#endif  // DELTAD_COMMON_LOG_LIMIT_H_
