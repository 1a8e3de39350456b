#ifndef DELTAD_POLICIES_WATERMARKS_H_
#define DELTAD_POLICIES_WATERMARKS_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace deltad::policy {

// When to start releasing and how far to go. Releasing starts when memory in
// use passes the high watermark (DELTA starts at 3/4 of the budget so copies
// overlap compute) and runs down to the low one, so one trigger frees enough
// for several allocations. Immutable; thread safe.
class Watermarks {
 public:
  static constexpr double kDefaultHigh = 0.75;
  static constexpr double kDefaultLow = 0.65;

  // 0 < low <= high <= 1.
  static absl::StatusOr<Watermarks> Create(double high = kDefaultHigh,
                                           double low = kDefaultLow);

  // Bytes to release so that `used + incoming` bytes fit a budget of
  // `budget` bytes: 0 while below the high mark, else down to the low mark.
  // InvalidArgument for a budget of zero or less; ResourceExhausted when the
  // incoming allocation alone is larger than the budget.
  absl::StatusOr<int64_t> BytesToFree(int64_t used, int64_t incoming,
                                      int64_t budget) const;

  double high() const { return high_; }
  double low() const { return low_; }

 private:
  Watermarks(double high, double low) : high_(high), low_(low) {}
  double high_;
  double low_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_WATERMARKS_H_
