#ifndef DELTAD_CLIENT_ARENA_DEVICE_H_
#define DELTAD_CLIENT_ARENA_DEVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "client/chunk_arena.h"
#include "client/chunk_mapper.h"
#include "client/device.h"
#include "common/unix_socket.h"

namespace deltad::client {

// A device whose memory is the chunks the daemon granted, mapped by a
// ChunkMapper into one ChunkArena. The arena is built when the first chunk
// arrives, since the chunk size is the daemon's. When no daemon grants any
// (none running), AddLocalChunks makes chunks in-process so the training
// still runs. Subclasses supply the copies and the local chunks: memfd
// chunks with throttled memcpy (SimChunkDevice) or CUDA (CudaDevice).
// Thread safe.
class ArenaDevice : public Device {
 public:
  // Ids of chunks made in-process have this bit set; they never go back to
  // the daemon.
  static constexpr uint64_t kLocalChunkBit = uint64_t{1} << 63;

  ArenaDevice(const ArenaDevice&) = delete;
  ArenaDevice& operator=(const ArenaDevice&) = delete;
  ~ArenaDevice() override;

  absl::StatusOr<void*> Allocate(int64_t bytes) override;
  void Free(void* device, int64_t bytes) override;
  absl::Status AddChunk(uint64_t chunk_id, int fd, int64_t bytes) override;
  std::vector<uint64_t> ShrinkChunksTo(int64_t bytes) override;
  int64_t chunk_bytes_held() const override;
  int64_t chunk_bytes_free() const override;
  int64_t chunk_bytes() const override;
  // Chunks of the daemon's size once one came, else local_chunk_bytes.
  absl::Status AddLocalChunks(int64_t bytes) override;

  // The chunk size when no daemon said otherwise: CUDA's allocation
  // granularity on current GPUs, as the daemon's default.
  static constexpr int64_t kLocalChunkBytes = int64_t{2} << 20;

  // Null until the first chunk arrives.
  const ChunkArena* arena() const;

 protected:
  // `max_bytes`: the most device memory the process will ever hold (the
  // GPU's memory); it sizes the address range the arena reserves.
  // `local_chunk_bytes`: the size of chunks made in-process before any
  // came from a daemon.
  ArenaDevice(std::unique_ptr<ChunkMapper> mapper, int64_t max_bytes,
              int64_t local_chunk_bytes = kLocalChunkBytes)
      : mapper_(std::move(mapper)),
        max_bytes_(max_bytes),
        local_chunk_bytes_(local_chunk_bytes) {}

  // A new chunk of `bytes` made in-process, as a descriptor the mapper can
  // import.
  virtual absl::StatusOr<common::UniqueFd> CreateLocalChunk(int64_t bytes) = 0;

 private:
  absl::StatusOr<ChunkArena*> ArenaFor(int64_t chunk_bytes);

  const std::unique_ptr<ChunkMapper> mapper_;
  const int64_t max_bytes_;
  const int64_t local_chunk_bytes_;
  mutable std::mutex mu_;  // guards the creation of arena_ and local ids
  std::unique_ptr<ChunkArena> arena_;
  // arena_ once made, read without mu_: it then lives as long as the
  // device, and the arena has a lock of its own.
  std::atomic<ChunkArena*> arena_ptr_{nullptr};
  uint64_t next_local_id_ = 1;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_ARENA_DEVICE_H_
