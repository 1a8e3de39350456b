#include "client/arena_device.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::client {

ArenaDevice::~ArenaDevice() {
  // The arena unmaps through the mapper, so it goes first.
  std::lock_guard<std::mutex> lock(mu_);
  arena_.reset();
}

const ChunkArena* ArenaDevice::arena() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_.get();
}

absl::StatusOr<ChunkArena*> ArenaDevice::ArenaFor(int64_t chunk_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (arena_ == nullptr) {
    auto arena = ChunkArena::Create(*mapper_, chunk_bytes, max_bytes_);
    if (!arena.ok()) return arena.status();
    arena_ = std::move(*arena);
  }
  return arena_.get();
}

absl::StatusOr<void*> ArenaDevice::Allocate(int64_t bytes) {
  ChunkArena* arena;
  {
    std::lock_guard<std::mutex> lock(mu_);
    arena = arena_.get();
  }
  if (arena == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no device memory for ", bytes, " bytes: no chunk was granted yet"));
  }
  return arena->Allocate(bytes);
}

void ArenaDevice::Free(void* device, int64_t bytes) {
  // The arena, once made, lives as long as the device and has its own
  // lock: mu_ only guards the pointer.
  ChunkArena* arena;
  {
    std::lock_guard<std::mutex> lock(mu_);
    arena = arena_.get();
  }
  if (arena != nullptr) arena->Free(device, bytes);
}

absl::Status ArenaDevice::AddChunk(uint64_t chunk_id, int fd, int64_t bytes) {
  auto arena = ArenaFor(bytes);
  if (!arena.ok()) return arena.status();
  return (*arena)->AddChunk(chunk_id, fd, bytes);
}

std::vector<uint64_t> ArenaDevice::ShrinkChunksTo(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (arena_ == nullptr) return {};
  std::vector<uint64_t> dropped = arena_->ShrinkTo(bytes);
  // Chunks made in-process are gone with their last descriptor; the daemon
  // never heard of them.
  std::erase_if(dropped, [](uint64_t id) { return id & kLocalChunkBit; });
  return dropped;
}

int64_t ArenaDevice::chunk_bytes_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_ == nullptr ? 0 : arena_->held_bytes();
}

int64_t ArenaDevice::chunk_bytes_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_ == nullptr ? 0 : arena_->free_bytes();
}

absl::Status ArenaDevice::AddLocalChunks(int64_t bytes) {
  auto arena = ArenaFor(local_chunk_bytes_);
  if (!arena.ok()) return arena.status();
  // An arena built for the daemon's chunks takes local ones of that size.
  const int64_t size = (*arena)->chunk_bytes();
  // Capped by the address range the arena reserved for the whole GPU.
  while ((*arena)->held_bytes() + size <= std::min(bytes, max_bytes_)) {
    auto fd = CreateLocalChunk(size);
    if (!fd.ok()) return fd.status();
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = kLocalChunkBit | next_local_id_++;
    }
    if (absl::Status s = (*arena)->AddChunk(id, fd->get(), size); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace deltad::client
