#ifndef DELTAD_DAEMON_BACKEND_CUDA_BACKEND_H_
#define DELTAD_DAEMON_BACKEND_CUDA_BACKEND_H_

#include <cuda.h>

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
#include "common/cuda_driver.h"
#include "daemon/backend/device_backend.h"

namespace deltad::daemon {

struct CudaBackendOptions {
  // The chunk size: 0 for each GPU's allocation granularity (2 MiB on
  // current GPUs); otherwise rounded up to a multiple of it.
  int64_t chunk_bytes = 0;
  // Time pinned copies each way at Create; otherwise, or when the probe
  // fails, every GPU gets fallback_bytes_per_s.
  bool measure_bandwidth = true;
  // Bytes per timed copy: large enough that the per-copy overhead (a few
  // microseconds) is lost in the transfer time.
  int64_t bandwidth_probe_bytes = int64_t{64} << 20;
  // PCIe 4.0 x16 effective, as SimBackendOptions.
  double fallback_bytes_per_s = 25e9;
};

// Device memory of the node's NVIDIA GPUs, as CUDA virtual-memory
// allocations (cuMemCreate) exported as POSIX file descriptors: a training
// process imports the fd it is sent (cuMemImportFromShareableHandle) and maps
// the chunk into its own address range. The daemon itself never maps or
// touches a chunk.
//
// GPUs are the ones CUDA sees (CUDA_VISIBLE_DEVICES applies), in CUDA's
// order, which puts the fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID.
//
// The daemon holds no CUDA context while it runs (a context costs hundreds
// of MiB of device memory on every GPU): the bandwidth probe runs in a
// context of its own, through the driver API only, destroyed before Create
// returns; cuMemCreate and the export are documented to need none (their
// error lists have no CUDA_ERROR_INVALID_CONTEXT). Should a driver want one
// after all, the GPU's primary context is retained on first need and kept,
// and made current for that GPU's creates and releases from then on. The
// CUDA runtime serves only to find the driver (CudaDriver::Get; it makes no
// context), so a process that also runs a CudaDevice (tests, benchmarks)
// shares no CUDA state with the backend beyond the driver itself.
//
// Thread safe. Owns the allocation handle and the fd of every live chunk and
// releases them on ReleaseChunk and on destruction.
class CudaBackend final : public DeviceBackend {
 public:
  // FAILED_PRECONDITION, with a one-line reason, when there is no driver,
  // no GPU, or a GPU lacks virtual memory management or POSIX
  // file-descriptor handles; INVALID_ARGUMENT for bad options
  // (chunk_bytes < 0 or larger than a GPU, probe bytes <= 0 when measuring,
  // a fallback bandwidth that is not positive and finite).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(
      CudaBackendOptions options);

  // Empty when CUDA is usable here (a driver and at least one GPU); else
  // the one-line reason, for a log line such as "no cuda backend: <reason>".
  // Costs a driver load the first time (cached after).
  static std::string ProbeCuda();

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;
  ~CudaBackend() override;

  absl::string_view name() const override { return "cuda"; }
  const std::vector<GpuInfo>& gpus() const override { return gpus_; }
  absl::StatusOr<DeviceChunk> CreateChunk(int gpu, int64_t bytes) override;
  absl::Status ReleaseChunk(uint64_t chunk_id) override;
  int64_t allocated_bytes(int gpu) const override;

  // What Create could not measure and assumed instead, one line each (e.g.
  // "GPU 0: bandwidth probe failed (...); assuming 25 GB/s each way"), for
  // the daemon to log. Empty when everything was measured. Fixed after
  // Create.
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  struct Chunk {
    DeviceChunk info;
    CUmemGenericAllocationHandle handle = 0;
  };

  CudaBackend(const common::CudaDriver& driver, std::vector<GpuInfo> gpus,
              std::vector<CUdevice> devices, std::vector<std::string> notes);

  // cuMemCreate + export on `gpu`, retrying in the GPU's primary context if
  // the driver wants one. Fills handle and fd.
  absl::Status Allocate(int gpu, int64_t bytes, Chunk& chunk);
  // `gpu`'s primary context if one was retained, else null.
  const common::PrimaryContext* ContextIfRetained(int gpu) const;
  // Retains `gpu`'s primary context, once, and keeps it.
  absl::StatusOr<const common::PrimaryContext*> RetainContext(int gpu);

  const common::CudaDriver& driver_;
  const std::vector<GpuInfo> gpus_;
  const std::vector<CUdevice> devices_;  // per GPU index
  const std::vector<std::string> notes_;

  // std::mutex rather than absl::Mutex: see SimBackend.
  mutable std::mutex mu_;
  // Rounded bytes of the live chunks, per GPU index, reserved before the
  // allocation is made so concurrent creates never exceed a GPU's memory.
  std::vector<int64_t> allocated_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, Chunk> chunks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Per GPU index; empty until a driver asks for a context.
  std::vector<std::unique_ptr<common::PrimaryContext>> contexts_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_BACKEND_CUDA_BACKEND_H_
