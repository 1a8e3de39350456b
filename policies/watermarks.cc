#include "policies/watermarks.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace deltad::policy {

absl::StatusOr<Watermarks> Watermarks::Create(double high, double low) {
  if (!(low > 0) || !(low <= high) || !(high <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "watermarks must satisfy 0 < low <= high <= 1, got low=", low,
        " high=", high));
  }
  return Watermarks(high, low);
}

absl::StatusOr<int64_t> Watermarks::BytesToFree(int64_t used, int64_t incoming,
                                                int64_t budget) const {
  if (budget <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget must be positive, got ", budget, " bytes"));
  }
  if (used < 0 || incoming < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "negative memory figures: used=", used, " incoming=", incoming));
  }
  if (incoming > budget) {
    return absl::ResourceExhaustedError(
        absl::StrCat("an allocation of ", incoming,
                     " bytes is larger than the whole budget of ", budget));
  }
  const double want = static_cast<double>(used + incoming);
  if (want <= high_ * static_cast<double>(budget)) return 0;
  const auto low_bytes =
      static_cast<int64_t>(std::floor(low_ * static_cast<double>(budget)));
  // Aim for the low mark, but never ask for more than is in use (a large
  // allocation may overshoot the low mark on its own) nor for less than what
  // makes the allocation fit at all.
  const int64_t must = std::max<int64_t>(0, used + incoming - budget);
  return std::clamp<int64_t>(used + incoming - low_bytes, must, used);
}

}  // namespace deltad::policy
