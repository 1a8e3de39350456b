#include "client/sim_chunk_mapper.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace deltad::client {
namespace {

constexpr int64_t kChunk = 2 << 20;

int Memfd(int64_t bytes) {
  const int fd = ::memfd_create("sim-chunk-mapper-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, bytes), 0);
  return fd;
}

// True when some mapping already covers [at, at + bytes): MAP_FIXED_NOREPLACE
// refuses to land on it.
bool Occupied(uintptr_t at, int64_t bytes) {
  void* p =
      ::mmap(reinterpret_cast<void*>(at), static_cast<size_t>(bytes), PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) return errno == EEXIST;
  ::munmap(p, static_cast<size_t>(bytes));
  return false;
}

// Two chunks of reserved address space and one memfd chunk imported for
// them, not mapped: what ReserveAndImport makes and ReleaseAll undoes.
struct ImportedChunk {
  uintptr_t base = 0;  // of the reservation, 2 * kChunk
  int fd = -1;         // the test's own descriptor of the memfd
  uint64_t handle = 0;
};

// Fails the test on error: call it under ASSERT_NO_FATAL_FAILURE.
void ReserveAndImport(SimChunkMapper& mapper, ImportedChunk* chunk) {
  auto base = mapper.Reserve(2 * kChunk, kChunk);
  ASSERT_TRUE(base.ok()) << base.status();
  chunk->base = *base;
  chunk->fd = Memfd(kChunk);
  auto handle = mapper.Import(chunk->fd, kChunk);
  ASSERT_TRUE(handle.ok()) << handle.status();
  chunk->handle = *handle;
}

void ReleaseAll(SimChunkMapper& mapper, const ImportedChunk& chunk) {
  mapper.Release(chunk.handle);
  mapper.Unreserve(chunk.base, 2 * kChunk);
  ::close(chunk.fd);
}

TEST(SimChunkMapper, ReservesAnAlignedRangeAndUnreserveFreesIt) {
  SimChunkMapper mapper;
  for (int i = 0; i < 4; ++i) {
    auto base = mapper.Reserve(8 * kChunk, kChunk);
    ASSERT_TRUE(base.ok()) << base.status();
    EXPECT_EQ(*base % kChunk, 0u);
    EXPECT_TRUE(Occupied(*base, 8 * kChunk));
    mapper.Unreserve(*base, 8 * kChunk);
    EXPECT_FALSE(Occupied(*base, 8 * kChunk));
  }
}

TEST(SimChunkMapper, ReserveRejectsSizesThatAreNotWholePages) {
  SimChunkMapper mapper;
  EXPECT_EQ(mapper.Reserve(0, kChunk).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mapper.Reserve(kChunk + 1, kChunk).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mapper.Reserve(kChunk, 100).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SimChunkMapper, AMappedChunkShowsTheMemfdAndWritesReachIt) {
  SimChunkMapper mapper;
  auto base = mapper.Reserve(4 * kChunk, kChunk);
  ASSERT_TRUE(base.ok()) << base.status();
  const int fd = Memfd(kChunk);
  const char before[] = "written through the descriptor";
  ASSERT_EQ(::pwrite(fd, before, sizeof(before), 100),
            static_cast<ssize_t>(sizeof(before)));
  auto handle = mapper.Import(fd, kChunk);
  ASSERT_TRUE(handle.ok()) << handle.status();

  const uintptr_t at = *base + 2 * kChunk;
  ASSERT_TRUE(mapper.Map(*handle, at, kChunk).ok());
  char* p = reinterpret_cast<char*>(at);
  EXPECT_STREQ(p + 100, before);
  std::memset(p + kChunk - 4096, 0x5a, 4096);
  std::vector<char> back(4096);
  ASSERT_EQ(::pread(fd, back.data(), back.size(), kChunk - 4096), 4096);
  for (char c : back) ASSERT_EQ(c, 0x5a);

  ASSERT_TRUE(mapper.Unmap(at, kChunk).ok());
  mapper.Release(*handle);
  mapper.Unreserve(*base, 4 * kChunk);
  ::close(fd);
}

TEST(SimChunkMapper, UnmapLeavesTheRangeReservedAndTheBytesInTheMemfd) {
  SimChunkMapper mapper;
  ImportedChunk chunk;
  ASSERT_NO_FATAL_FAILURE(ReserveAndImport(mapper, &chunk));
  const uintptr_t base = chunk.base;
  ASSERT_TRUE(mapper.Map(chunk.handle, base, kChunk).ok());
  reinterpret_cast<char*>(base)[7] = 42;
  ASSERT_TRUE(mapper.Unmap(base, kChunk).ok());

  EXPECT_TRUE(Occupied(base, kChunk));
  char c = 0;
  ASSERT_EQ(::pread(chunk.fd, &c, 1, 7), 1);
  EXPECT_EQ(c, 42);
  // Mapped again elsewhere in the range, the chunk still holds its bytes.
  ASSERT_TRUE(mapper.Map(chunk.handle, base + kChunk, kChunk).ok());
  EXPECT_EQ(reinterpret_cast<char*>(base + kChunk)[7], 42);
  ASSERT_TRUE(mapper.Unmap(base + kChunk, kChunk).ok());
  ReleaseAll(mapper, chunk);
}

TEST(SimChunkMapper, MapAndUnmapRefuseRangesOutsideTheReservation) {
  SimChunkMapper mapper;
  ImportedChunk chunk;
  ASSERT_NO_FATAL_FAILURE(ReserveAndImport(mapper, &chunk));
  const uintptr_t base = chunk.base;
  EXPECT_EQ(mapper.Map(chunk.handle, base + 2 * kChunk, kChunk).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mapper.Map(chunk.handle, base + kChunk + 4096, kChunk).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mapper.Map(chunk.handle, base - kChunk, kChunk).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mapper.Unmap(base + 2 * kChunk, kChunk).code(),
            absl::StatusCode::kInvalidArgument);
  ReleaseAll(mapper, chunk);
}

TEST(SimChunkMapper, ImportKeepsItsOwnDescriptorAndRejectsATooSmallFile) {
  SimChunkMapper mapper;
  const int small = Memfd(kChunk / 2);
  EXPECT_EQ(mapper.Import(small, kChunk).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(mapper.Import(-1, kChunk).ok());
  ::close(small);

  const int fd = Memfd(kChunk);
  auto handle = mapper.Import(fd, kChunk);
  ASSERT_TRUE(handle.ok()) << handle.status();
  const int dup = static_cast<int>(*handle);
  EXPECT_NE(dup, fd);
  EXPECT_EQ(::fcntl(dup, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  ::close(fd);  // the caller's copy; the chunk stays reachable
  auto base = mapper.Reserve(kChunk, kChunk);
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_TRUE(mapper.Map(*handle, *base, kChunk).ok());
  EXPECT_TRUE(mapper.Unmap(*base, kChunk).ok());

  mapper.Release(*handle);
  errno = 0;
  EXPECT_EQ(::fcntl(dup, F_GETFD), -1);
  EXPECT_EQ(errno, EBADF);
  mapper.Unreserve(*base, kChunk);
}

}  // namespace
}  // namespace deltad::client
