#include "policies/sim/lower_bounds.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace deltad::sim {

namespace {

int64_t CeilNs(double bytes, double bytes_per_s) {
  return static_cast<int64_t>(std::ceil(1e9 * bytes / bytes_per_s));
}

}  // namespace

LowerBounds ComputeLowerBounds(const Program& program,
                               const DeviceProfile& device,
                               int64_t budget_bytes) {
  LowerBounds lb;
  lb.compute_ns = program.compute_ns;
  lb.swap_only_ns = program.compute_ns;
  const int64_t excess =
      std::max<int64_t>(0, program.peak_bytes - budget_bytes);
  if (excess == 0) return lb;
  if (device.d2h_bytes_per_s <= 0 || device.h2d_bytes_per_s <= 0) {
    // Nothing can leave the device: no swap-only schedule fits.
    lb.swap_only_ns = std::numeric_limits<int64_t>::max();
    return lb;
  }
  // The excess must be copied out before the peak step and back after it,
  // once each way. With the paper's single link of bandwidth beta that is
  // 2 * excess / beta. The two directions are separate engines here, so
  // each is charged at its own rate: this equals the paper's bound when
  // they match, and stays a lower bound when they differ (charging both at
  // the slower rate would not be).
  const auto bytes = static_cast<double>(excess);
  const int64_t copy_ns = CeilNs(bytes, device.d2h_bytes_per_s) +
                          CeilNs(bytes, device.h2d_bytes_per_s);
  lb.swap_only_ns = std::max(lb.compute_ns, copy_ns);
  return lb;
}

}  // namespace deltad::sim
