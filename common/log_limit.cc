#include "common/log_limit.h"

namespace deltad::common {

bool LogLimit::AllowAt(Clock::time_point now, int64_t* held_back) {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_window_ == 0 || now - window_start_ >= window_) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= burst_) {
    ++held_back_;
    return false;
  }
  ++in_window_;
  if (held_back != nullptr) *held_back = held_back_;
  held_back_ = 0;
  return true;
}

}  // namespace deltad::common
