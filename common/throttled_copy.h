#ifndef DELTAD_COMMON_THROTTLED_COPY_H_
#define DELTAD_COMMON_THROTTLED_COPY_H_

#include <chrono>
#include <cstdint>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace deltad::common {

// Copies bytes at no more than a given average rate, so a simulated executor
// that moves real bytes between host buffers and sim chunks takes about as
// long as a copy over the GPU's host link would.
//
// Thread safe. Concurrent Copy calls share the one rate, as copies queued on
// one copy engine share its link: use one ThrottledCopy per direction per
// GPU. Copies go in pieces of kPieceBytes, each given a slot on a timeline of
// the link; a copy sleeps until its pieces' slots have passed. Idle time
// earns no credit, so a copy after a pause is not faster than the rate.
class ThrottledCopy {
 public:
  static constexpr int64_t kPieceBytes = int64_t{4} << 20;

  // bytes_per_s <= 0 (or NaN) copies unthrottled.
  explicit ThrottledCopy(double bytes_per_s);

  ThrottledCopy(const ThrottledCopy&) = delete;
  ThrottledCopy& operator=(const ThrottledCopy&) = delete;

  // Copies `bytes` bytes from `src` to `dst`, which must not overlap;
  // nothing for bytes <= 0. Returns when the bytes are copied and the time
  // the link needs for them has passed.
  void Copy(void* dst, const void* src, int64_t bytes);

  double bytes_per_s() const { return bytes_per_s_; }

 private:
  using Clock = std::chrono::steady_clock;

  const double bytes_per_s_;  // 0 when unthrottled.
  std::mutex mu_;
  // When the link finishes the pieces given slots so far; in the past when
  // the link is idle.
  Clock::time_point link_free_at_ ABSL_GUARDED_BY(mu_);
};

}  // namespace deltad::common

#endif  // DELTAD_COMMON_THROTTLED_COPY_H_
