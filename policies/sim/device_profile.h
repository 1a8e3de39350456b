#ifndef DELTAD_POLICIES_SIM_DEVICE_PROFILE_H_
#define DELTAD_POLICIES_SIM_DEVICE_PROFILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::sim {

enum class DType : uint8_t { kFp32, kFp16 };
inline int64_t DTypeBytes(DType t) { return t == DType::kFp32 ? 4 : 2; }

// A GPU as the simulator and the model traces see it. Every number states
// its source in `source`.
struct DeviceProfile {
  std::string name;   // e.g. "a100-80gb"
  std::string title;  // e.g. "NVIDIA A100 80GB SXM4"
  int64_t memory_bytes = 0;
  // Effective host-link bandwidth with pinned memory, each way.
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  // 2: one copy engine per direction (D2H and H2D overlap); 1: they queue.
  int copy_engines = 2;
  // Sustained rates the model traces use to time ops: dense math (matmul,
  // convolution) per dtype, and device memory bandwidth for elementwise ops.
  double fp32_flops_per_s = 0;
  double fp16_flops_per_s = 0;
  double memory_bytes_per_s = 0;
  std::string source;
};

// Titan V 12 GB, V100 16 GB, A100 80 GB, H100 80 GB.
const std::vector<DeviceProfile>& DeviceProfiles();
absl::StatusOr<DeviceProfile> FindDeviceProfile(absl::string_view name);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_DEVICE_PROFILE_H_
