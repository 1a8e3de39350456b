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
  // What CUDA reports as the card's global memory (totalGlobalMem), less
  // than the marketed capacity.
  int64_t memory_bytes = 0;
  // What a PyTorch process holds before its first tensor: the CUDA context
  // with the kernels of PyTorch's CUDA libraries loaded, for the CUDA
  // generation of the profile's era (eager module loading before CUDA
  // 12.2, lazy since).
  int64_t context_bytes = 0;
  // cuBLAS and cuBLASLt workspaces, which PyTorch allocates through its
  // caching allocator at the first matmul and keeps.
  int64_t blas_workspace_bytes = 0;
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

  // What a training run can allocate for its tensors.
  int64_t usable_bytes() const {
    return memory_bytes - context_bytes - blas_workspace_bytes;
  }
};

// Titan V 12 GB, V100 16 GB, A100 80 GB, H100 80 GB.
const std::vector<DeviceProfile>& DeviceProfiles();
absl::StatusOr<DeviceProfile> FindDeviceProfile(absl::string_view name);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_DEVICE_PROFILE_H_
