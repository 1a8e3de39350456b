#include "common/throttled_copy.h"

#include <algorithm>
#include <cstring>
#include <thread>

namespace deltad::common {

ThrottledCopy::ThrottledCopy(double bytes_per_s)
    : bytes_per_s_(bytes_per_s > 0 ? bytes_per_s : 0) {}

void ThrottledCopy::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return;
  if (bytes_per_s_ == 0) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  for (int64_t offset = 0; offset < bytes; offset += kPieceBytes) {
    const int64_t n = std::min(kPieceBytes, bytes - offset);
    Clock::time_point slot_end;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A piece starts when the link is free or now, whichever is later:
      // an idle link banks no time.
      const Clock::time_point start = std::max(Clock::now(), link_free_at_);
      link_free_at_ =
          start + std::chrono::ceil<Clock::duration>(
                      std::chrono::duration<double>(n / bytes_per_s_));
      slot_end = link_free_at_;
    }
    std::memcpy(out + offset, in + offset, static_cast<size_t>(n));
    // When memcpy itself is slower than the rate, slot_end has passed and
    // this returns at once.
    std::this_thread::sleep_until(slot_end);
  }
}

}  // namespace deltad::common
