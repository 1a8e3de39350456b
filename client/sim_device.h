#ifndef DELTAD_CLIENT_SIM_DEVICE_H_
#define DELTAD_CLIENT_SIM_DEVICE_H_

#include <atomic>
#include <cstdint>

#include "client/device.h"
#include "common/throttled_copy.h"

namespace deltad::client {

// A GPU simulated in host memory: allocations come from the process heap
// up to `capacity_bytes`, and copies really move the bytes, throttled to the
// link's bandwidth each way, so offloads and reloads take about as long as
// they would over PCIe. Thread safe.
class SimDevice final : public Device {
 public:
  // Bandwidths <= 0 copy at memcpy speed.
  SimDevice(int64_t capacity_bytes, double d2h_bytes_per_s,
            double h2d_bytes_per_s)
      : capacity_(capacity_bytes),
        d2h_(d2h_bytes_per_s),
        h2d_(h2d_bytes_per_s) {}

  absl::string_view name() const override { return "sim"; }
  absl::StatusOr<void*> Allocate(int64_t bytes) override;
  void Free(void* device, int64_t bytes) override;
  void CopyToHost(void* host, const void* device, int64_t bytes) override {
    d2h_.Copy(host, device, bytes);
  }
  void CopyToDevice(void* device, const void* host, int64_t bytes) override {
    h2d_.Copy(device, host, bytes);
  }

  int64_t allocated_bytes() const { return allocated_.load(); }

 private:
  const int64_t capacity_;
  std::atomic<int64_t> allocated_{0};
  common::ThrottledCopy d2h_;
  common::ThrottledCopy h2d_;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_SIM_DEVICE_H_
