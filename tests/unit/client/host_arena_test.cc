#include "client/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"

namespace deltad::client {
namespace {

int Memfd(int64_t bytes) {
  const int fd = ::memfd_create("arena-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, bytes), 0);
  return fd;
}

TEST(HostArena, PlacesBlocksInSlabsAndCoalescesFreedOnes) {
  HostArena arena;
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, 1).ok());
  EXPECT_EQ(arena.capacity_bytes(), 1 << 20);
  auto a = arena.Allocate(300 << 10);
  auto b = arena.Allocate(300 << 10);
  auto c = arena.Allocate(300 << 10);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::memset(a->data, 1, a->bytes);
  std::memset(c->data, 3, c->bytes);
  EXPECT_EQ(arena.Allocate(300 << 10).status().code(),
            absl::StatusCode::kResourceExhausted);
  arena.Free(*a);
  arena.Free(*b);
  // a and b coalesced: 600 KiB in one piece.
  auto big = arena.Allocate(600 << 10);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(static_cast<unsigned char>(c->data[0]), 3);
  arena.Free(*big);
  arena.Free(*c);
  EXPECT_EQ(arena.used_bytes(), 0);
}

TEST(HostArena, UsesTheHeapAllowanceOnlyWhenSlabsAreFull) {
  HostArena arena;
  EXPECT_EQ(arena.Allocate(4096).status().code(),
            absl::StatusCode::kResourceExhausted);
  arena.SetHeapAllowance(int64_t{64} << 20);
  auto a = arena.Allocate(4096);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(arena.Allocate(int64_t{65} << 20).status().code(),
            absl::StatusCode::kResourceExhausted);
  arena.Free(*a);
}

TEST(HostArena, RetiredSlabsTakeNoNewBlocksAndUnmapWhenEmpty) {
  HostArena arena;
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, 7).ok());
  auto a = arena.Allocate(4096);
  ASSERT_TRUE(a.ok());
  arena.Retire(7);
  EXPECT_TRUE(arena.IsRetired(*a));
  EXPECT_FALSE(arena.Allocate(4096).ok());  // no heap allowance either
  arena.UnmapRetired();                     // still holds a block: kept
  EXPECT_EQ(arena.capacity_bytes(), 1 << 20);
  arena.Free(*a);
  arena.UnmapRetired();
  EXPECT_EQ(arena.capacity_bytes(), 0);
}

TEST(HostArena, RejectsNonPositiveSizes) {
  HostArena arena;
  arena.SetHeapAllowance(1 << 30);
  EXPECT_EQ(arena.Allocate(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena.Allocate(-5).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deltad::client
