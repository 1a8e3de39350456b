#ifndef DELTAD_CLIENT_DEVICE_H_
#define DELTAD_CLIENT_DEVICE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::client {

// The GPU as the client's executor uses it: device memory and the two copy
// directions over the host link. Two implementations: the simulated device
// (client/sim_device.h, host memory standing in for device memory, copies
// throttled to the link's bandwidth) and the CUDA device.
//
// Implementations are thread safe: the compute thread and the executor
// thread call them at once.
class Device {
 public:
  virtual ~Device() = default;

  virtual absl::string_view name() const = 0;
  // RESOURCE_EXHAUSTED when the device has no room for `bytes`.
  virtual absl::StatusOr<void*> Allocate(int64_t bytes) = 0;
  // `bytes` as given to Allocate.
  virtual void Free(void* device, int64_t bytes) = 0;
  // Each returns when the bytes have arrived.
  virtual void CopyToHost(void* host, const void* device, int64_t bytes) = 0;
  virtual void CopyToDevice(void* device, const void* host, int64_t bytes) = 0;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_DEVICE_H_
