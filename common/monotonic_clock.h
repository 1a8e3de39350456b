#ifndef DELTAD_COMMON_MONOTONIC_CLOCK_H_
#define DELTAD_COMMON_MONOTONIC_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace deltad::common {

// Nanoseconds on the steady clock: for intervals and deadlines within one
// process, never for wall time.
inline int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace deltad::common

#endif  // DELTAD_COMMON_MONOTONIC_CLOCK_H_
