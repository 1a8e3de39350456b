#ifndef DELTAD_TESTS_UNIT_CLIENT_CHUNK_ARENA_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_CLIENT_CHUNK_ARENA_TEST_HELPERS_H_

// What the chunk_arena_*_test.cc files share: a mapper that records what
// the arena asks of it, and arenas over it or over memfd chunks.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/chunk_arena.h"
#include "client/sim_chunk_mapper.h"
#include "gtest/gtest.h"

namespace deltad::client {

// Records what the arena asks of it, maps nothing, and fails on request.
class FakeMapper : public ChunkMapper {
 public:
  static constexpr uintptr_t kBase = uintptr_t{1} << 44;

  absl::StatusOr<uintptr_t> Reserve(int64_t bytes, int64_t alignment) override {
    reserved_bytes = bytes;
    reserved_alignment = alignment;
    return kBase;
  }
  void Unreserve(uintptr_t base, int64_t bytes) override {
    unreserved.emplace_back(base, bytes);
  }
  absl::StatusOr<uint64_t> Import(int fd, int64_t bytes) override {
    (void)bytes;
    const uint64_t handle = next_handle++;
    live_handles.insert(handle);
    fd_of_handle[handle] = fd;
    return handle;
  }
  absl::Status Map(uint64_t handle, uintptr_t at, int64_t bytes) override {
    if (maps_before_failure == 0) {
      return absl::InternalError("told to fail this Map");
    }
    if (maps_before_failure > 0) --maps_before_failure;
    EXPECT_EQ(bytes, chunk_bytes);
    EXPECT_TRUE(live_handles.contains(handle));
    EXPECT_FALSE(mapped.contains(at)) << "mapped twice at " << at;
    for (const auto& [where, h] : mapped) {
      EXPECT_NE(h, handle) << "one chunk mapped at two places";
    }
    mapped[at] = handle;
    map_calls.emplace_back(handle, at);
    return absl::OkStatus();
  }
  absl::Status Unmap(uintptr_t at, int64_t bytes) override {
    EXPECT_EQ(bytes, chunk_bytes);
    ++unmap_calls;
    if (fail_unmaps) return absl::InternalError("told to fail this Unmap");
    EXPECT_EQ(mapped.erase(at), 1u) << "unmapped what was not mapped";
    return absl::OkStatus();
  }
  void Release(uint64_t handle) override {
    EXPECT_FALSE(mapped_handle(handle)) << "released while mapped";
    EXPECT_EQ(live_handles.erase(handle), 1u);
    released.push_back(handle);
  }

  bool mapped_handle(uint64_t handle) const {
    for (const auto& [at, h] : mapped) {
      if (h == handle) return true;
    }
    return false;
  }

  int64_t chunk_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t reserved_alignment = 0;
  uint64_t next_handle = 100;
  std::set<uint64_t> live_handles;
  std::map<uint64_t, int> fd_of_handle;
  std::map<uintptr_t, uint64_t> mapped;  // address -> handle
  std::vector<std::pair<uint64_t, uintptr_t>> map_calls;
  int unmap_calls = 0;
  std::vector<uint64_t> released;
  std::vector<std::pair<uintptr_t, int64_t>> unreserved;
  int maps_before_failure = -1;  // -1: never fail
  bool fail_unmaps = false;
};

inline constexpr int64_t kChunk = 64 << 10;

// An arena over a FakeMapper holding `chunks` chunks with ids 0, 1, ...
// The fake mapper never reads the descriptors, so they are made up.
struct FakeSetup {
  explicit FakeSetup(int chunks, int64_t max_bytes = 16 * kChunk) {
    mapper.chunk_bytes = kChunk;
    auto created = ChunkArena::Create(mapper, kChunk, max_bytes);
    EXPECT_TRUE(created.ok()) << created.status();
    arena = *std::move(created);
    for (int i = 0; i < chunks; ++i) {
      EXPECT_TRUE(
          arena->AddChunk(static_cast<uint64_t>(i), 1000 + i, kChunk).ok());
    }
  }
  FakeMapper mapper;
  std::unique_ptr<ChunkArena> arena;
};

inline int Memfd(int64_t bytes) {
  const int fd = ::memfd_create("chunk-arena-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, bytes), 0);
  return fd;
}

// An arena over memfd chunks; the test keeps its descriptors to read what
// reached each chunk.
struct SimSetup {
  explicit SimSetup(int chunks, int64_t max_bytes = 64 * kChunk) {
    auto created = ChunkArena::Create(mapper, kChunk, max_bytes);
    EXPECT_TRUE(created.ok()) << created.status();
    arena = *std::move(created);
    for (int i = 0; i < chunks; ++i) {
      fds.push_back(Memfd(kChunk));
      EXPECT_TRUE(
          arena->AddChunk(static_cast<uint64_t>(i), fds.back(), kChunk).ok());
    }
  }
  ~SimSetup() {
    arena.reset();
    for (int fd : fds) ::close(fd);
  }
  std::vector<unsigned char> Contents(int chunk) const {
    std::vector<unsigned char> bytes(kChunk);
    EXPECT_EQ(::pread(fds[static_cast<size_t>(chunk)], bytes.data(), kChunk, 0),
              kChunk);
    return bytes;
  }
  SimChunkMapper mapper;
  std::unique_ptr<ChunkArena> arena;
  std::vector<int> fds;
};

}  // namespace deltad::client

#endif  // DELTAD_TESTS_UNIT_CLIENT_CHUNK_ARENA_TEST_HELPERS_H_
