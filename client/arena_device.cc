#include "client/arena_device.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::client {

ArenaDevice::~ArenaDevice() {
  // The arena unmaps through the mapper, so it goes first.
  std::lock_guard<std::mutex> lock(mu_);
  arena_ptr_.store(nullptr, std::memory_order_release);
  arena_.reset();
}

const ChunkArena* ArenaDevice::arena() const {
  return arena_ptr_.load(std::memory_order_acquire);
}

absl::StatusOr<ChunkArena*> ArenaDevice::ArenaFor(int64_t chunk_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (arena_ == nullptr) {
    auto arena = ChunkArena::Create(*mapper_, chunk_bytes, max_bytes_);
    if (!arena.ok()) return arena.status();
    arena_ = std::move(*arena);
    arena_ptr_.store(arena_.get(), std::memory_order_release);
  }
  return arena_.get();
}

absl::StatusOr<void*> ArenaDevice::Allocate(int64_t bytes) {
  ChunkArena* arena = arena_ptr_.load(std::memory_order_acquire);
  if (arena == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no device memory for ", bytes, " bytes: no chunk was granted yet"));
  }
  return arena->Allocate(bytes);
}

void ArenaDevice::Free(void* device, int64_t bytes) {
  ChunkArena* arena = arena_ptr_.load(std::memory_order_acquire);
  if (arena != nullptr) arena->Free(device, bytes);
}

absl::Status ArenaDevice::AddChunk(uint64_t chunk_id, int fd, int64_t bytes) {
  auto arena = ArenaFor(bytes);
  if (!arena.ok()) return arena.status();
  return (*arena)->AddChunk(chunk_id, fd, bytes);
}

std::vector<uint64_t> ArenaDevice::ShrinkChunksTo(int64_t bytes) {
  ChunkArena* arena = arena_ptr_.load(std::memory_order_acquire);
  if (arena == nullptr) return {};
  std::vector<uint64_t> dropped = arena->ShrinkTo(bytes);
  // Chunks made in-process are gone with their last descriptor; the daemon
  // never heard of them.
  std::erase_if(dropped, [](uint64_t id) { return id & kLocalChunkBit; });
  return dropped;
}

int64_t ArenaDevice::chunk_bytes_held() const {
  const ChunkArena* arena = arena_ptr_.load(std::memory_order_acquire);
  return arena == nullptr ? 0 : arena->held_bytes();
}

int64_t ArenaDevice::chunk_bytes_free() const {
  const ChunkArena* arena = arena_ptr_.load(std::memory_order_acquire);
  return arena == nullptr ? 0 : arena->free_bytes();
}

int64_t ArenaDevice::chunk_bytes() const {
  const ChunkArena* arena = arena_ptr_.load(std::memory_order_acquire);
  return arena == nullptr ? local_chunk_bytes_ : arena->chunk_bytes();
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
