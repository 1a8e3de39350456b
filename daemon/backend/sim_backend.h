#ifndef DELTAD_DAEMON_BACKEND_SIM_BACKEND_H_
#define DELTAD_DAEMON_BACKEND_SIM_BACKEND_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/backend/device_backend.h"

namespace deltad::daemon {

struct SimBackendOptions {
  int gpus = 8;
  // Per GPU; 80 GiB as on an A100 or H100 80GB.
  int64_t memory_bytes = int64_t{80} << 30;
  // The granularity chunks are rounded up to; 2 MiB is what
  // cuMemGetAllocationGranularity reports on current NVIDIA GPUs. Must be a
  // multiple of the host page size, since chunks are mmap'ed.
  int64_t chunk_bytes = int64_t{2} << 20;
  // PCIe 4.0 x16 effective: pinned cudaMemcpy reaches about 25 GB/s each way
  // on A100 hosts (80% of the 31.5 GB/s left after 128b/130b encoding), the
  // same figure as the a100-80gb profile in policies/sim/device_profile.cc.
  double d2h_bytes_per_s = 25e9;
  double h2d_bytes_per_s = 25e9;
  std::string name = "deltad simulated GPU";
};

// Device memory simulated with host memory: every chunk is a memfd of the
// rounded size, which the owning process maps exactly as it would map a CUDA
// chunk exported as a POSIX fd. Memfd pages are allocated lazily on first
// touch, so 8 GPUs x 80 GiB of budget cost no host memory until a process
// writes into its chunks; the accounting enforces the simulated capacity.
//
// Thread safe. Owns the fds of its live chunks and closes them on release
// and on destruction.
class SimBackend final : public DeviceBackend {
 public:
  // InvalidArgument naming the offending option: gpus in [1, kMaxGpus];
  // memory_bytes > 0; chunk_bytes > 0, a multiple of the page size and at
  // most memory_bytes; bandwidths positive and finite; a non-empty name.
  static absl::StatusOr<std::unique_ptr<SimBackend>> Create(
      SimBackendOptions options);

  // NVML and CUDA number GPUs in small ints; 64 is more than any node holds
  // and keeps the fake PCI bus ids within one byte.
  static constexpr int kMaxGpus = 64;

  SimBackend(const SimBackend&) = delete;
  SimBackend& operator=(const SimBackend&) = delete;
  ~SimBackend() override;

  absl::string_view name() const override { return "sim"; }
  const std::vector<GpuInfo>& gpus() const override { return gpus_; }
  absl::StatusOr<DeviceChunk> CreateChunk(int gpu, int64_t bytes) override;
  absl::Status ReleaseChunk(uint64_t chunk_id) override;
  int64_t allocated_bytes(int gpu) const override;

 private:
  explicit SimBackend(std::vector<GpuInfo> gpus);

  const std::vector<GpuInfo> gpus_;

  // std::mutex rather than absl::Mutex throughout the project: Debian's
  // Abseil is not built with ThreadSanitizer, which then cannot see
  // absl::Mutex and reports races on correctly locked data.
  mutable std::mutex mu_;
  // Rounded bytes of the live chunks, per GPU index. Reserved before the
  // memfd is made, so concurrent creates never exceed a GPU's memory.
  std::vector<int64_t> allocated_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, DeviceChunk> chunks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_BACKEND_SIM_BACKEND_H_
