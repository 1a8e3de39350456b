#ifndef DELTAD_DAEMON_BACKEND_CHUNK_REQUEST_H_
#define DELTAD_DAEMON_BACKEND_CHUNK_REQUEST_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/backend/device_backend.h"

namespace deltad::daemon {

// A DeviceBackend::CreateChunk request as every backend handles it: checked,
// rounded up to the GPU's chunk granularity, then reserved against the GPU's
// memory beside the chunks already allocated on it. The backend makes the
// chunk itself.
struct ChunkRequest {
  int gpu = 0;
  int64_t bytes = 0;         // as asked
  int64_t rounded = 0;       // a multiple of the granularity, or `bytes` when
                             // that multiple would exceed the GPU's memory
  bool fits_at_all = false;  // the rounded size is within the GPU's memory
  int64_t memory_bytes = 0;  // the GPU's
  int64_t granularity = 0;   // the GPU's

  // InvalidArgument for a GPU not in `gpus` or bytes <= 0; `backend` ("sim",
  // "cuda") names the backend in the message.
  static absl::StatusOr<ChunkRequest> Make(absl::string_view backend,
                                           const std::vector<GpuInfo>& gpus,
                                           int gpu, int64_t bytes);

  // Adds `rounded` to `allocated`, the bytes of the GPU's live chunks, or
  // ResourceExhausted (saying how much is free) when they do not fit beside
  // them. Not thread safe: the backend calls it under its lock.
  absl::Status Reserve(int64_t& allocated) const;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_BACKEND_CHUNK_REQUEST_H_
