#ifndef DELTAD_DAEMON_BACKEND_DEVICE_BACKEND_H_
#define DELTAD_DAEMON_BACKEND_DEVICE_BACKEND_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::daemon {

// One GPU as the daemon sees it. Fixed for the life of the backend.
struct GpuInfo {
  int index = 0;           // 0-based, dense: the GPU's position in gpus().
  std::string name;        // e.g. "NVIDIA H100 80GB HBM3".
  std::string uuid;        // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
  std::string pci_bus_id;  // "dddddddd:bb:dd.f", as nvidia-smi prints it.
  // NUMA node of the host memory nearest the GPU, so the host pool can put
  // pinned slabs there; -1 when there is none, as sysfs reports it.
  int numa_node = -1;
  int64_t memory_bytes = 0;  // The budget the daemon may hand out.
  // Effective host-link bandwidth with pinned memory, each way; the cost
  // model times offloads and reloads with these.
  double d2h_bytes_per_s = 0;
  double h2d_bytes_per_s = 0;
  // Every chunk is a multiple of this (the physical allocation granularity
  // of CUDA virtual memory; a page multiple for the sim backend).
  int64_t chunk_granularity = 0;
};

// A piece of one GPU's physical memory that a training process maps into its
// reserved address range. The daemon passes `fd` to that process over the
// Unix socket (SCM_RIGHTS), which gives the process its own descriptor.
struct DeviceChunk {
  uint64_t id = 0;    // Unique within the backend; never 0.
  int gpu = 0;        // GpuInfo::index.
  int64_t bytes = 0;  // Rounded up to the GPU's chunk_granularity.
  // Owned by the backend and closed by ReleaseChunk: borrow it to send it,
  // never close it. A process that received a copy keeps the memory alive
  // until it unmaps and closes its copy, so release a chunk only once its
  // owner has let go of it (or has exited); the accounting cannot see
  // mappings in other processes.
  int fd = -1;
};

// Physical device memory, handed out in chunks and accounted per GPU. Two
// implementations: `cuda` (cuMemCreate with POSIX fd handles) and `sim`
// (memfd chunks standing in for device memory). The backend moves no bytes:
// the process that maps a chunk does.
//
// Implementations are thread safe: the arbiters of different GPUs call one
// backend concurrently.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // Short backend name for logs and metrics labels: "cuda", "sim".
  virtual absl::string_view name() const = 0;

  // One entry per GPU, entry i has index i. Fixed after creation, so the
  // reference stays valid and unchanged for the life of the backend.
  virtual const std::vector<GpuInfo>& gpus() const = 0;

  // A new chunk of at least `bytes` on `gpu`, rounded up to the GPU's
  // granularity. InvalidArgument for an unknown GPU or bytes <= 0;
  // ResourceExhausted when the rounded size does not fit the GPU's memory
  // beside the chunks already allocated on it.
  virtual absl::StatusOr<DeviceChunk> CreateChunk(int gpu, int64_t bytes) = 0;

  // Returns the chunk's bytes to its GPU and closes the backend's fd.
  // NotFound for an id never created or already released.
  virtual absl::Status ReleaseChunk(uint64_t chunk_id) = 0;

  // Bytes of the chunks currently allocated on `gpu` (rounded sizes); 0 for
  // a GPU that does not exist.
  virtual int64_t allocated_bytes(int gpu) const = 0;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_BACKEND_DEVICE_BACKEND_H_
