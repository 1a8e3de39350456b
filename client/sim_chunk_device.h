#ifndef DELTAD_CLIENT_SIM_CHUNK_DEVICE_H_
#define DELTAD_CLIENT_SIM_CHUNK_DEVICE_H_

#include <cstdint>
#include <memory>

#include "client/arena_device.h"
#include "common/throttled_copy.h"

namespace deltad::client {

// A simulated GPU whose memory is the daemon's sim-backend chunks (memfds),
// mapped into one reserved range exactly as a CUDA device maps its chunks:
// the chunk protocol, the arena and the budget enforcement run in CI
// without a GPU. Copies really move the bytes, throttled to the link's
// bandwidth. Thread safe.
class SimChunkDevice final : public ArenaDevice {
 public:
  // `max_bytes`: the simulated GPU's memory (sizes the address range).
  // Bandwidths <= 0 copy at memcpy speed. `local_chunk_bytes`: the chunk
  // size while no daemon grants any (a page multiple; scaled-down
  // simulations scale it with their tensors).
  static absl::StatusOr<std::unique_ptr<SimChunkDevice>> Create(
      int64_t max_bytes, double d2h_bytes_per_s, double h2d_bytes_per_s,
      int64_t local_chunk_bytes = kLocalChunkBytes);

  absl::string_view name() const override { return "sim-chunks"; }
  absl::string_view chunk_backend() const override { return "sim"; }
  void CopyToHost(void* host, const void* device, int64_t bytes) override {
    d2h_.Copy(host, device, bytes);
  }
  void CopyToDevice(void* device, const void* host, int64_t bytes) override {
    h2d_.Copy(device, host, bytes);
  }

 private:
  SimChunkDevice(std::unique_ptr<ChunkMapper> mapper, int64_t max_bytes,
                 double d2h, double h2d, int64_t local_chunk_bytes)
      : ArenaDevice(std::move(mapper), max_bytes, local_chunk_bytes),
        d2h_(d2h),
        h2d_(h2d) {}
  absl::StatusOr<common::UniqueFd> CreateLocalChunk(int64_t bytes) override;

  common::ThrottledCopy d2h_;
  common::ThrottledCopy h2d_;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_SIM_CHUNK_DEVICE_H_
