#include "policies/sim/caching_allocator_model.h"

#include <memory>

#include "gtest/gtest.h"

namespace deltad::sim {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::unique_ptr<AllocatorModel> Make(int64_t capacity) {
  return MakeAllocatorModel(AllocatorKind::kPyTorchCaching, capacity, 0);
}

TEST(CachingAllocator, SmallRequestsShareOneTwoMibSegment) {
  auto a = Make(100 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 100));   // rounds to 512 bytes
  ASSERT_TRUE(a->Allocate(2, kMiB));  // the largest small request
  ASSERT_TRUE(a->Allocate(3, 1000));
  EXPECT_EQ(a->footprint(), 2 * kMiB);  // one small segment
  ASSERT_TRUE(a->Allocate(4, kMiB));    // no room left in it: a second
  EXPECT_EQ(a->footprint(), 4 * kMiB);
}

TEST(CachingAllocator, MidSizedRequestsTakeTwentyMibSegmentsAndSplitThem) {
  auto a = Make(100 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 3 * kMiB));  // under 10 MiB: a 20 MiB segment
  EXPECT_EQ(a->footprint(), 20 * kMiB);
  ASSERT_TRUE(a->Allocate(2, 5 * kMiB));  // split from the 17 MiB rest
  // The last 12 MiB, whole: a rest of 1 MiB is not split off.
  ASSERT_TRUE(a->Allocate(3, 11 * kMiB));
  EXPECT_EQ(a->footprint(), 20 * kMiB);
  ASSERT_TRUE(a->Allocate(4, 2 * kMiB));  // nothing left: a new segment
  EXPECT_EQ(a->footprint(), 40 * kMiB);
}

TEST(CachingAllocator, LargeRequestsRoundToTwoMib) {
  auto a = Make(100 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 10 * kMiB + 1));
  EXPECT_EQ(a->footprint(), 12 * kMiB);
  ASSERT_TRUE(a->Allocate(2, 30 * kMiB));
  EXPECT_EQ(a->footprint(), 42 * kMiB);
}

TEST(CachingAllocator, FreedBlocksStayReservedAndAreReused) {
  auto a = Make(100 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 30 * kMiB));
  a->Free(1);
  EXPECT_EQ(a->footprint(), 30 * kMiB);    // cached, not returned
  ASSERT_TRUE(a->Allocate(2, 24 * kMiB));  // best fit inside it
  EXPECT_EQ(a->footprint(), 30 * kMiB);
  // The 6 MiB rest was split off and is reused.
  ASSERT_TRUE(a->Allocate(3, 5 * kMiB));
  EXPECT_EQ(a->footprint(), 30 * kMiB);
}

TEST(CachingAllocator, ALargeRemainderOfAtMostOneMibIsNotSplitOff) {
  auto a = Make(100 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 12 * kMiB));
  a->Free(1);
  // 11.5 MiB leaves 0.5 MiB, which stays with the block.
  ASSERT_TRUE(a->Allocate(2, 11 * kMiB + kMiB / 2));
  EXPECT_EQ(a->AdjacentFree(2), 0);
  ASSERT_TRUE(a->Allocate(3, 400 * 1024));  // small pool: a new segment
  EXPECT_EQ(a->footprint(), 14 * kMiB);
}

TEST(CachingAllocator, FreedNeighboursMergeWithinASegment) {
  auto a = Make(100 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 40 * kMiB));
  a->Free(1);
  ASSERT_TRUE(a->Allocate(2, 10 * kMiB));
  ASSERT_TRUE(a->Allocate(3, 10 * kMiB));
  ASSERT_TRUE(a->Allocate(4, 10 * kMiB));
  EXPECT_EQ(a->AdjacentFree(4), 10 * kMiB);
  a->Free(2);
  a->Free(3);
  EXPECT_EQ(a->AdjacentFree(4), 30 * kMiB);
  // The 20 MiB hole before block 4 holds a 20 MiB request again.
  ASSERT_TRUE(a->Allocate(5, 20 * kMiB));
  EXPECT_EQ(a->footprint(), 40 * kMiB);
}

TEST(CachingAllocator, BlocksOfTwoSegmentsNeverMerge) {
  auto a = Make(60 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 20 * kMiB));
  ASSERT_TRUE(a->Allocate(2, 20 * kMiB));
  a->Free(1);
  a->Free(2);
  // Two free 20 MiB segments, not one of 40: a new segment is needed, and
  // for it both cached ones are released.
  ASSERT_TRUE(a->Allocate(3, 40 * kMiB));
  EXPECT_EQ(a->footprint(), 40 * kMiB);
}

TEST(CachingAllocator, CachedSegmentsAreReleasedBeforeRunningOutOfMemory) {
  auto a = Make(64 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 30 * kMiB));
  ASSERT_TRUE(a->Allocate(2, 30 * kMiB));
  a->Free(1);
  // 30 MiB cached and 4 free: a 34 MiB segment fits only once the cached
  // one is released.
  ASSERT_TRUE(a->Allocate(3, 34 * kMiB));
  EXPECT_EQ(a->footprint(), 64 * kMiB);
  EXPECT_FALSE(a->Allocate(4, 1));
}

TEST(CachingAllocator, FragmentationCanRefuseWhatTheFreeBytesWouldHold) {
  auto a = Make(60 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 60 * kMiB));
  a->Free(1);
  ASSERT_TRUE(a->Allocate(2, 20 * kMiB));
  ASSERT_TRUE(a->Allocate(3, 20 * kMiB));
  ASSERT_TRUE(a->Allocate(4, 20 * kMiB));
  a->Free(2);
  a->Free(4);
  // 40 MiB free in two holes of one partly used segment: 30 MiB fits in
  // neither and no new segment fits the device.
  EXPECT_FALSE(a->Allocate(5, 30 * kMiB));
  EXPECT_TRUE(a->Allocate(6, 20 * kMiB));
}

}  // namespace
}  // namespace deltad::sim
