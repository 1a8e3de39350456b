#ifndef DELTAD_COMMON_CUDA_SPIN_KERNEL_H_
#define DELTAD_COMMON_CUDA_SPIN_KERNEL_H_

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda_driver.h"

namespace deltad::common {

// A kernel that keeps the GPU busy for a given number of SM clock cycles
// and touches no memory: compute that copies can overlap with, for the
// benchmarks' copy/compute overlap figures. One thread in one block spins
// on %clock64, so the copy engines and the other SMs stay free.
//
// Written in PTX and JIT-compiled by the driver when loaded (the build has
// no nvcc); the PTX targets sm_75, the oldest architecture CUDA 13 supports.
//
// Thread safe: Launch may be called from any thread. Owns the module, which
// it unloads on destruction, and a reference to the device's primary
// context, in which the module lives.
class SpinKernel {
 public:
  // Loads the kernel into the primary context of device `ordinal`.
  // FAILED_PRECONDITION without a driver or GPU (CudaDriver::Get).
  static absl::StatusOr<std::unique_ptr<SpinKernel>> Load(int ordinal);

  SpinKernel(const SpinKernel&) = delete;
  SpinKernel& operator=(const SpinKernel&) = delete;
  ~SpinKernel();

  // Queues the kernel on `stream` (a stream of this device; a cudaStream_t
  // is the same type, and nullptr the legacy default stream) to spin for
  // `cycles` >= 0 SM clock cycles. Returns at once.
  absl::Status Launch(CUstream stream, int64_t cycles) const;

  // The module's PTX source.
  static const char* Ptx();

 private:
  SpinKernel(PrimaryContext context, CUmodule module, CUfunction function)
      : context_(std::move(context)), module_(module), function_(function) {}

  PrimaryContext context_;
  CUmodule module_ = nullptr;
  CUfunction function_ = nullptr;
};

}  // namespace deltad::common

#endif  // DELTAD_COMMON_CUDA_SPIN_KERNEL_H_
