#include "client/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>
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
  std::memset(a->pieces[0].data, 1, a->bytes);
  std::memset(c->pieces[0].data, 3, c->bytes);
  EXPECT_EQ(arena.Allocate(300 << 10).status().code(),
            absl::StatusCode::kResourceExhausted);
  arena.Free(*a);
  arena.Free(*b);
  // a and b coalesced: 600 KiB in one piece.
  auto big = arena.Allocate(600 << 10);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(static_cast<unsigned char>(c->pieces[0].data[0]), 3);
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

// Writes byte i of the block as `seed + i`, piece by piece.
void Fill(const HostArena::Block& b, int seed) {
  HostArena::ForEachPiece(b, [&](char* p, int64_t at, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<char>(seed + at + i);
  });
}
// How many bytes of the block differ from what Fill wrote.
int64_t Mismatches(const HostArena::Block& b, int seed) {
  int64_t bad = 0;
  int64_t seen = 0;
  HostArena::ForEachPiece(b, [&](char* p, int64_t at, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      bad += p[i] != static_cast<char>(seed + at + i);
    }
    seen += n;
  });
  return bad + (b.bytes - seen);
}

TEST(HostArena, FreeRoomSplitByOtherBlocksHoldsABlockInPieces) {
  HostArena arena;
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, 1).ok());
  std::vector<HostArena::Block> quarters;
  for (int i = 0; i < 4; ++i) {
    auto q = arena.Allocate(256 << 10);
    ASSERT_TRUE(q.ok()) << q.status();
    quarters.push_back(*q);
  }
  arena.Free(quarters[0]);
  arena.Free(quarters[2]);
  // 512 KiB free, in two pieces of 256 KiB: enough for 500 KiB.
  EXPECT_EQ(arena.available_bytes(), 512 << 10);
  auto split = arena.Allocate(500 << 10);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->pieces.size(), 2u);
  EXPECT_EQ(split->bytes, 500 << 10);
  Fill(*split, 5);
  EXPECT_EQ(Mismatches(*split, 5), 0);
  EXPECT_EQ(arena.Allocate(64 << 10).status().code(),
            absl::StatusCode::kResourceExhausted);
  arena.Free(*split);
  arena.Free(quarters[1]);
  arena.Free(quarters[3]);
  EXPECT_EQ(arena.used_bytes(), 0);
  // Coalesced again: the whole slab in one piece.
  auto whole = arena.Allocate(1 << 20);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->pieces.size(), 1u);
  arena.Free(*whole);
}

TEST(HostArena, ABlockLargerThanASlabSpansSlabs) {
  HostArena arena;
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, 1).ok());
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, 1).ok());
  auto big = arena.Allocate((3 << 20) / 2);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->pieces.size(), 2u);
  Fill(*big, 9);
  EXPECT_EQ(Mismatches(*big, 9), 0);
  EXPECT_EQ(arena.used_bytes(), (3 << 20) / 2);
  // More than the slabs hold: refused, nothing taken.
  EXPECT_EQ(arena.Allocate(1 << 20).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(arena.used_bytes(), (3 << 20) / 2);
  arena.Free(*big);
  EXPECT_EQ(arena.used_bytes(), 0);
}

TEST(HostArena, PiecesSmallerThanTheMinimumAreNotGathered) {
  HostArena arena;
  ASSERT_TRUE(arena.AddSlab(Memfd(256 << 10), 256 << 10, 1).ok());
  // Eight blocks of 32 KiB; every other one freed: 128 KiB free, all of
  // it in pieces under HostArena::kMinPieceBytes.
  std::vector<HostArena::Block> blocks;
  for (int i = 0; i < 8; ++i) {
    auto b = arena.Allocate(32 << 10);
    ASSERT_TRUE(b.ok()) << b.status();
    blocks.push_back(*b);
  }
  for (int i = 0; i < 8; i += 2) arena.Free(blocks[i]);
  auto refused = arena.Allocate(100 << 10);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("not even in pieces"),
            std::string::npos)
      << refused.status();
  // A block that fits one of them still goes in one piece.
  auto small = arena.Allocate(30 << 10);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->pieces.size(), 1u);
}

TEST(HostArena, CopyMovesBytesBetweenBlocksWhosePiecesDoNotLineUp) {
  HostArena arena;
  ASSERT_TRUE(arena.AddSlab(Memfd(1 << 20), 1 << 20, 1).ok());
  // A block in two pieces of 128 KiB and 256 KiB ...
  auto a = arena.Allocate(128 << 10);
  auto gap = arena.Allocate(64 << 10);
  auto b = arena.Allocate(256 << 10);
  auto gap2 = arena.Allocate(64 << 10);
  ASSERT_TRUE(a.ok() && gap.ok() && b.ok() && gap2.ok());
  arena.Free(*a);
  arena.Free(*b);
  auto rest = arena.Allocate((1 << 20) - (128 << 10) - (256 << 10) -
                             (128 << 10));  // the slab's tail
  ASSERT_TRUE(rest.ok()) << rest.status();
  auto from = arena.Allocate(384 << 10);
  ASSERT_TRUE(from.ok()) << from.status();
  ASSERT_EQ(from->pieces.size(), 2u);
  Fill(*from, 3);
  // ... into one of a single piece, made where the tail was.
  arena.Free(*rest);
  auto to = arena.Allocate(384 << 10);
  ASSERT_TRUE(to.ok()) << to.status();
  ASSERT_EQ(to->pieces.size(), 1u);
  HostArena::Copy(*from, *to);
  EXPECT_EQ(Mismatches(*to, 3), 0);
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
    std::memset(a->pieces[0].data, 7, 4096);
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
