#include "client/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <utility>
#include <vector>

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

TEST(HostArena, AnAllowanceBelowOneHeapRegionIsUsedWhole) {
  HostArena arena;
  arena.SetHeapAllowance(int64_t{8} << 20);
  auto a = arena.Allocate(int64_t{3} << 20);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = arena.Allocate(int64_t{5} << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(arena.Allocate(4096).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(arena.capacity_bytes(), int64_t{8} << 20);
  arena.Free(*a);
  arena.Free(*b);
}

// An allowance that is no whole number of 256-byte units (a budget's bytes,
// as the trainer gives) made a heap region of that odd size, which
// aligned_alloc does not take (AddressSanitizer aborted on it).
TEST(HostArena, AHeapRegionIsAWholeNumberOfAlignmentUnits) {
  HostArena arena;
  arena.SetHeapAllowance((int64_t{8} << 20) + 100);
  auto a = arena.Allocate(int64_t{3} << 20);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(arena.capacity_bytes(), int64_t{8} << 20);
  arena.Free(*a);
}

// A client that reaches a daemon lowers its heap allowance to zero with
// heap already taken (offloads made while the daemon was away). What is
// left free in that heap is still offered, and no more heap is taken: an
// allowance below what is taken once counted negative, so the in-process
// policy saw less host memory than there was.
TEST(HostArena, AnAllowanceLoweredBelowTheTakenHeapStillOffersItsFreeRoom) {
  HostArena arena;
  arena.SetHeapAllowance(int64_t{8} << 20);
  auto a = arena.Allocate(int64_t{3} << 20);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, 7).ok());
  arena.SetHeapAllowance(0);
  EXPECT_EQ(arena.available_bytes(), (int64_t{5} << 20) + (1 << 20));
  auto b = arena.Allocate(int64_t{5} << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  auto c = arena.Allocate(1 << 20);  // the slab
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(arena.available_bytes(), 0);
  EXPECT_EQ(arena.Allocate(4096).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(arena.capacity_bytes(), (int64_t{8} << 20) + (1 << 20));
  arena.Free(*a);
  arena.Free(*b);
  arena.Free(*c);
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

// What the device was asked to pin and unpin, and whether pinning fails.
struct PinLog {
  std::vector<std::pair<void*, int64_t>> pinned;
  std::vector<void*> unpinned;
  bool fail = false;
};

HostArena::Pinner PinnerFor(PinLog& log) {
  return {[&log](void* p, int64_t n) {
            log.pinned.emplace_back(p, n);
            return log.fail ? absl::InternalError("cannot pin")
                            : absl::OkStatus();
          },
          [&log](void* p) { log.unpinned.push_back(p); }};
}

TEST(HostArena, PinsEachRegionOnceAndUnpinsItBeforeItGoes) {
  PinLog log;
  {
    HostArena arena;
    arena.SetPinner(PinnerFor(log));
    ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, /*owner=*/1).ok());
    arena.SetHeapAllowance(int64_t{64} << 20);
    // Two blocks in the slab, then one that needs a heap region.
    auto a = arena.Allocate(256 << 10);
    auto b = arena.Allocate(256 << 10);
    auto c = arena.Allocate(1 << 20);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    ASSERT_EQ(log.pinned.size(), 2u) << "one pin per region, not per block";
    EXPECT_EQ(log.pinned[0].second, 1 << 20);
    EXPECT_EQ(log.pinned[1].second, int64_t{64} << 20);
    EXPECT_TRUE(log.unpinned.empty());
    // A retired slab is unpinned before it is unmapped.
    arena.Free(*a);
    arena.Free(*b);
    arena.Retire(1);
    arena.UnmapRetired();
    ASSERT_EQ(log.unpinned.size(), 1u);
    EXPECT_EQ(log.unpinned[0], log.pinned[0].first);
    arena.Free(*c);
  }
  // The heap region, at destruction.
  ASSERT_EQ(log.unpinned.size(), 2u);
  EXPECT_EQ(log.unpinned[1], log.pinned[1].first);
}

TEST(HostArena, ARegionThatCannotBePinnedIsStillUsedAndNeverUnpinned) {
  PinLog log;
  log.fail = true;
  {
    HostArena arena;
    arena.SetPinner(PinnerFor(log));
    ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, /*owner=*/1).ok());
    auto a = arena.Allocate(4096);
    ASSERT_TRUE(a.ok()) << a.status();
    std::memset(a->data, 7, 4096);
    arena.Free(*a);
  }
  EXPECT_EQ(log.pinned.size(), 1u);
  EXPECT_TRUE(log.unpinned.empty());
}

TEST(HostArena, AvailableBytesCountTheHeapOnceAndLeaveRetiredSlabsOut) {
  HostArena arena;
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, /*owner=*/1).ok());
  arena.SetHeapAllowance(int64_t{128} << 20);
  EXPECT_EQ(arena.available_bytes(), (1 << 20) + (int64_t{128} << 20));
  // A block that opens a 64 MiB heap region: the region's free part and
  // the rest of the allowance, the region not counted twice.
  auto block = arena.Allocate(2 << 20);
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ(arena.available_bytes(),
            (1 << 20) + (int64_t{128} << 20) - (2 << 20));
  // A retired slab takes no new blocks.
  arena.Retire(1);
  EXPECT_EQ(arena.available_bytes(), (int64_t{128} << 20) - (2 << 20));
  arena.Free(*block);
}

}  // namespace
}  // namespace deltad::client
