#ifndef DELTAD_CLIENT_DEVICE_H_
#define DELTAD_CLIENT_DEVICE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::client {

// The GPU as the client's executor uses it: device memory and the two copy
// directions over the host link. Three implementations: the heap-backed
// simulated device (client/sim_device.h), and two chunk-backed ones over a
// ChunkArena (client/arena_device.h): memfd chunks standing in for device
// memory (client/sim_chunk_device.h) and CUDA (client/cuda_device.h).
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
  // Each returns when the bytes have arrived, and, for CopyToHost, once the
  // work the process queued on its compute stream before the call (which
  // may still be writing the tensor) is done.
  virtual void CopyToHost(void* host, const void* device, int64_t bytes) = 0;
  virtual void CopyToDevice(void* device, const void* host, int64_t bytes) = 0;

  // Host memory the copies go to and from (the daemon's slabs, the heap
  // fallback), announced once per region so that a CUDA device can pin it
  // (cudaHostRegister) once rather than per copy.
  virtual absl::Status RegisterHost(void* /*host*/, int64_t /*bytes*/) {
    return absl::OkStatus();
  }
  virtual void UnregisterHost(void* /*host*/) {}

  // --- Device memory from the daemon's chunks (DeviceBackend::CreateChunk).
  // A chunk-backed device allocates only from the chunks it was given; the
  // heap-backed sim device allocates on its own and takes none.

  // The backend whose chunks this device maps ("sim", "cuda"), or empty for
  // a device that takes no chunks.
  virtual absl::string_view chunk_backend() const { return {}; }
  // Maps a chunk; `fd` stays the caller's (close it after).
  virtual absl::Status AddChunk(uint64_t /*chunk_id*/, int /*fd*/,
                                int64_t /*bytes*/) {
    return absl::FailedPreconditionError("this device takes no chunks");
  }
  // Unmaps unused chunks until at most `bytes` of chunks are held; returns
  // the ids of those dropped, for the daemon to release.
  virtual std::vector<uint64_t> ShrinkChunksTo(int64_t /*bytes*/) { return {}; }
  virtual int64_t chunk_bytes_held() const { return 0; }
  // Chunks held and not mapped by any allocation, in bytes.
  virtual int64_t chunk_bytes_free() const { return 0; }
  // The size of the chunks it maps (0: none).
  virtual int64_t chunk_bytes() const { return 0; }
  // No daemon grants chunks (none reachable): makes chunks in-process until
  // `bytes` are held, so the training still runs.
  virtual absl::Status AddLocalChunks(int64_t /*bytes*/) {
    return absl::OkStatus();
  }
  // The GPU's UUID as the daemon reports it ("GPU-..."), or empty when the
  // device cannot tell (simulated devices).
  virtual std::string gpu_uuid() const { return {}; }
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_DEVICE_H_
