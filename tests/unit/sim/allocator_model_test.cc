#include "policies/sim/allocator_model.h"

#include <algorithm>
#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(AllocatorKind, NamesParseBackToTheirKind) {
  for (AllocatorKind kind :
       {AllocatorKind::kExact, AllocatorKind::kBestFit,
        AllocatorKind::kVmChunks, AllocatorKind::kPyTorchCaching}) {
    auto parsed = ParseAllocatorKind(AllocatorKindName(kind));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_EQ(AllocatorKindName(AllocatorKind::kExact), "exact");
  EXPECT_EQ(AllocatorKindName(AllocatorKind::kBestFit), "best-fit");
  EXPECT_EQ(AllocatorKindName(AllocatorKind::kVmChunks), "vm-chunks");
  EXPECT_EQ(AllocatorKindName(AllocatorKind::kPyTorchCaching),
            "pytorch-caching");
}

TEST(AllocatorKind, UnknownNameErrorListsTheKnownNames) {
  auto parsed = ParseAllocatorKind("first-fit");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr("'first-fit'"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("exact"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("best-fit"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("vm-chunks"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("pytorch-caching"));
}

TEST(ExactAllocator, StopsAtCapacityWithoutRounding) {
  auto a = MakeAllocatorModel(AllocatorKind::kExact, 1000, 0);
  EXPECT_EQ(a->capacity(), 1000);
  ASSERT_TRUE(a->Allocate(1, 599));
  EXPECT_EQ(a->used(), 599);
  EXPECT_FALSE(a->Allocate(2, 402));
  EXPECT_EQ(a->used(), 599);
  ASSERT_TRUE(a->Allocate(2, 401));  // exactly full
  EXPECT_EQ(a->used(), 1000);
  EXPECT_FALSE(a->Allocate(3, 1));
}

TEST(ExactAllocator, FreeReturnsTheBytes) {
  auto a = MakeAllocatorModel(AllocatorKind::kExact, 1000, 0);
  ASSERT_TRUE(a->Allocate(1, 600));
  ASSERT_TRUE(a->Allocate(2, 300));
  a->Free(1);
  EXPECT_EQ(a->used(), 300);
  EXPECT_TRUE(a->Allocate(3, 700));
  // Freeing an unknown or already freed block changes nothing.
  a->Free(1);
  a->Free(42);
  EXPECT_EQ(a->used(), 1000);
  EXPECT_EQ(a->AdjacentFree(2), 0);
}

TEST(BestFitAllocator, RoundsTo512Bytes) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 8192, 0);
  ASSERT_TRUE(a->Allocate(1, 1));
  EXPECT_EQ(a->used(), 512);
  ASSERT_TRUE(a->Allocate(2, 512));
  EXPECT_EQ(a->used(), 1024);
  ASSERT_TRUE(a->Allocate(3, 513));
  EXPECT_EQ(a->used(), 2048);
  a->Free(3);
  EXPECT_EQ(a->used(), 1024);
}

TEST(BestFitAllocator, RoundingCountsAgainstCapacity) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 1024, 0);
  ASSERT_TRUE(a->Allocate(1, 513));  // takes the whole arena
  EXPECT_FALSE(a->Allocate(2, 1));
}

// Lays out [A 512][hole 2048][C 512][hole 1024][E 512] in a 4608-byte arena.
std::unique_ptr<AllocatorModel> TwoHoles() {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 4608, 0);
  EXPECT_TRUE(a->Allocate(1, 512));   // A at 0
  EXPECT_TRUE(a->Allocate(2, 2048));  // hole at 512
  EXPECT_TRUE(a->Allocate(3, 512));   // C at 2560
  EXPECT_TRUE(a->Allocate(4, 1024));  // hole at 3072
  EXPECT_TRUE(a->Allocate(5, 512));   // E at 4096
  EXPECT_EQ(a->used(), 4608);
  a->Free(2);
  a->Free(4);
  return a;
}

TEST(BestFitAllocator, ChoosesTheSmallestHoleThatFits) {
  auto a = TwoHoles();
  // First fit would take the 2048-byte hole (lower address) and leave 1024
  // free beside the block.
  ASSERT_TRUE(a->Allocate(10, 1000));
  EXPECT_EQ(a->AdjacentFree(10), 0);
  // The large hole is intact.
  EXPECT_TRUE(a->Allocate(11, 2048));
  EXPECT_EQ(a->used(), 4608);
}

TEST(BestFitAllocator, TakesTheFrontOfALargerHole) {
  auto a = TwoHoles();
  ASSERT_TRUE(a->Allocate(10, 1536));  // only the 2048 hole fits
  EXPECT_EQ(a->AdjacentFree(10), 512);
  EXPECT_TRUE(a->Allocate(11, 1024));
  EXPECT_TRUE(a->Allocate(12, 512));
  EXPECT_FALSE(a->Allocate(13, 1));
}

TEST(BestFitAllocator, FragmentationFailsWithEnoughFreeBytes) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 4096, 0);
  for (int64_t id = 0; id < 4; ++id) ASSERT_TRUE(a->Allocate(id, 1024));
  a->Free(0);
  a->Free(2);
  EXPECT_EQ(a->capacity() - a->used(), 2048);
  EXPECT_FALSE(a->Allocate(10, 2048));
  EXPECT_FALSE(a->Allocate(10, 1025));
  EXPECT_TRUE(a->Allocate(10, 1024));
}

TEST(BestFitAllocator, FreesTheCheapestMovableRangeThatHoldsABlock) {
  // 1 KiB blocks 1..8 fill 8 KiB; freeing 2, 4 and 7 leaves 3 KiB free in
  // three holes, and 2 KiB fits none of them.
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 8192, 0);
  for (int64_t id = 1; id <= 8; ++id) ASSERT_TRUE(a->Allocate(id, 1024));
  for (int64_t id : {2, 4, 7}) a->Free(id);
  ASSERT_FALSE(a->Allocate(9, 2048));
  auto all = [](int64_t) { return true; };
  // One block beside a hole frees 2 KiB: the first such, block 1 or 3.
  std::vector<int64_t> ids = a->BlocksToFreeForRange(2048, all);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_TRUE(ids[0] == 1 || ids[0] == 3) << ids[0];
  // With blocks 1, 3, 5, 6 and 8 held, no range can hold it.
  auto none_of = [](std::vector<int64_t> held) {
    return [held](int64_t id) {
      return std::find(held.begin(), held.end(), id) == held.end();
    };
  };
  EXPECT_TRUE(a->BlocksToFreeForRange(2048, none_of({1, 3, 5, 6, 8})).empty());
  // With 1, 3 and 8 held, only block 5 or 6 next to a hole can go: 6 lies
  // between 5 and the hole of 7, 5 between the hole of 4 and 6.
  ids = a->BlocksToFreeForRange(2048, none_of({1, 3, 8}));
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_TRUE(ids[0] == 5 || ids[0] == 6) << ids[0];
  for (int64_t id : ids) a->Free(id);
  EXPECT_TRUE(a->Allocate(9, 2048));

  // 3 KiB between held 3 and 8, with holes where 4 and 7 were: the hole of
  // 4 with 5 and 6, or 5, 6 and the hole of 7; two blocks either way.
  auto b = MakeAllocatorModel(AllocatorKind::kBestFit, 8192, 0);
  for (int64_t id = 1; id <= 8; ++id) ASSERT_TRUE(b->Allocate(id, 1024));
  b->Free(4);
  b->Free(7);
  ids = b->BlocksToFreeForRange(3072, none_of({1, 2, 3, 8}));
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, (std::vector<int64_t>{5, 6}));
  for (int64_t id : ids) b->Free(id);
  EXPECT_TRUE(b->Allocate(9, 3072));
}

TEST(AllocatorModel, ModelsWithoutAddressesNameNoRangeToFree) {
  for (AllocatorKind kind : {AllocatorKind::kExact, AllocatorKind::kVmChunks,
                             AllocatorKind::kPyTorchCaching}) {
    auto a = MakeAllocatorModel(kind, int64_t{64} << 20, 1024);
    ASSERT_TRUE(a->Allocate(1, 4096));
    EXPECT_TRUE(
        a->BlocksToFreeForRange(8192, [](int64_t) { return true; }).empty())
        << AllocatorKindName(kind);
  }
}

TEST(BestFitAllocator, FreeingANeighbourOnBothSidesMerges) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 4096, 0);
  for (int64_t id = 0; id < 4; ++id) ASSERT_TRUE(a->Allocate(id, 1024));
  a->Free(0);
  a->Free(2);
  ASSERT_FALSE(a->Allocate(10, 3072));
  a->Free(1);  // joins the holes before and after it
  EXPECT_TRUE(a->Allocate(10, 3072));
  EXPECT_EQ(a->used(), 4096);
}

TEST(BestFitAllocator, FreeingMergesWithTheHoleAfter) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 3072, 0);
  for (int64_t id = 0; id < 3; ++id) ASSERT_TRUE(a->Allocate(id, 1024));
  a->Free(1);
  a->Free(0);
  EXPECT_TRUE(a->Allocate(10, 2048));
}

TEST(BestFitAllocator, FreeingMergesWithTheHoleBefore) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 3072, 0);
  for (int64_t id = 0; id < 3; ++id) ASSERT_TRUE(a->Allocate(id, 1024));
  a->Free(0);
  a->Free(1);
  EXPECT_TRUE(a->Allocate(10, 2048));
}

TEST(BestFitAllocator, MergedHolesStayMergedAcrossManyFrees) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 8 * 512, 0);
  for (int64_t id = 0; id < 8; ++id) ASSERT_TRUE(a->Allocate(id, 512));
  for (int64_t id : {6, 1, 3, 0, 7, 5, 2, 4}) a->Free(id);
  EXPECT_EQ(a->used(), 0);
  EXPECT_TRUE(a->Allocate(10, 8 * 512));
}

TEST(BestFitAllocator, AdjacentFreeCountsBothSides) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 5120, 0);
  for (int64_t id = 0; id < 4; ++id) ASSERT_TRUE(a->Allocate(id, 1024));
  // 1024 free at the end of the arena.
  EXPECT_EQ(a->AdjacentFree(3), 1024);
  EXPECT_EQ(a->AdjacentFree(1), 0);
  a->Free(0);
  EXPECT_EQ(a->AdjacentFree(1), 1024);  // before
  a->Free(2);
  EXPECT_EQ(a->AdjacentFree(1), 2048);  // before and after
  // Block 3 now has 1024 free before it and 1024 after it.
  EXPECT_EQ(a->AdjacentFree(3), 2048);
  EXPECT_EQ(a->AdjacentFree(99), 0);  // unknown block
}

TEST(BestFitAllocator, FootprintCountsTheHolesBelowTheTop) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 8192, 0);
  for (int64_t id = 0; id < 4; ++id) ASSERT_TRUE(a->Allocate(id, 1024));
  a->Free(1);
  EXPECT_EQ(a->used(), 3072);
  EXPECT_EQ(a->footprint(), 4096);  // the hole at 1024 is still spanned
  a->Free(3);
  EXPECT_EQ(a->footprint(), 3072);  // the top block went: the top comes down
  a->Free(2);
  EXPECT_EQ(a->footprint(), 1024);  // with the hole it now reaches
}

TEST(BestFitAllocator, ARunFitsAgainUnderACapacityOfItsPeakFootprint) {
  // Placement does not depend on the capacity: the same requests land in
  // the same places in a roomy arena and in one just as large as the
  // roomy run's peak footprint.
  auto run = [](AllocatorModel& a, int64_t* peak) {
    bool ok = true;
    auto alloc = [&](int64_t id, int64_t bytes) {
      ok = ok && a.Allocate(id, bytes);
      *peak = std::max(*peak, a.footprint());
    };
    alloc(1, 2048);
    alloc(2, 512);
    alloc(3, 2048);
    a.Free(1);
    alloc(4, 1024);  // into the hole, not on top
    alloc(5, 1536);  // the rest of the hole is too small: on top
    a.Free(3);
    alloc(6, 2560);  // the hole 3 left, merged with nothing
    a.Free(5);
    alloc(7, 4096);
    return ok;
  };
  auto roomy = MakeAllocatorModel(AllocatorKind::kBestFit, 1 << 20, 0);
  int64_t peak = 0;
  ASSERT_TRUE(run(*roomy, &peak));
  auto tight = MakeAllocatorModel(AllocatorKind::kBestFit, peak, 0);
  int64_t tight_peak = 0;
  EXPECT_TRUE(run(*tight, &tight_peak));
  EXPECT_EQ(tight_peak, peak);
  EXPECT_EQ(tight->footprint(), roomy->footprint());
  EXPECT_GT(peak, roomy->used());  // the holes count
}

TEST(VmChunksAllocator, RoundsLargeBlocksToWholeChunks) {
  auto a = MakeAllocatorModel(AllocatorKind::kVmChunks, 64 * kMiB, 2 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 3 * kMiB));
  EXPECT_EQ(a->used(), 4 * kMiB);
  ASSERT_TRUE(a->Allocate(2, 2 * kMiB));
  EXPECT_EQ(a->used(), 6 * kMiB);
  ASSERT_TRUE(a->Allocate(3, 2 * kMiB + 1));
  EXPECT_EQ(a->used(), 10 * kMiB);
  a->Free(1);
  EXPECT_EQ(a->used(), 6 * kMiB);
  EXPECT_EQ(a->AdjacentFree(2), 0);
}

TEST(VmChunksAllocator, RoundsSmallBlocksTo512Bytes) {
  auto a = MakeAllocatorModel(AllocatorKind::kVmChunks, 64 * kMiB, 2 * kMiB);
  ASSERT_TRUE(a->Allocate(1, 100));
  EXPECT_EQ(a->used(), 512);
  ASSERT_TRUE(a->Allocate(2, kMiB + 1));
  EXPECT_EQ(a->used(), 512 + kMiB + 512);
}

TEST(VmChunksAllocator, RoundingCanExceedCapacityWhereExactFits) {
  auto exact = MakeAllocatorModel(AllocatorKind::kExact, 6 * kMiB, 0);
  auto chunks =
      MakeAllocatorModel(AllocatorKind::kVmChunks, 6 * kMiB, 2 * kMiB);
  EXPECT_TRUE(exact->Allocate(1, 3 * kMiB));
  EXPECT_TRUE(exact->Allocate(2, 3 * kMiB));
  EXPECT_TRUE(chunks->Allocate(1, 3 * kMiB));
  EXPECT_FALSE(chunks->Allocate(2, 3 * kMiB));
}

TEST(VmChunksAllocator, DefaultsTo2MiBChunks) {
  auto a = MakeAllocatorModel(AllocatorKind::kVmChunks, 64 * kMiB, 0);
  ASSERT_TRUE(a->Allocate(1, 3 * kMiB));
  EXPECT_EQ(a->used(), 4 * kMiB);
}

// Regression: a zero-byte block (DTR's logs hold empty tensors) was placed at
// the start of a free range and broke the merging on free, corrupting the
// arena's maps.
TEST(AllocatorModel, BestFitEmptyBlocksTakeNoSpaceAndFreeCleanly) {
  auto a = MakeAllocatorModel(AllocatorKind::kBestFit, 4096, 0);
  ASSERT_TRUE(a->Allocate(1, 0));
  ASSERT_TRUE(a->Allocate(2, 0));
  ASSERT_TRUE(a->Allocate(3, 1024));
  EXPECT_EQ(a->used(), 1024);
  EXPECT_EQ(a->AdjacentFree(1), 0);
  a->Free(1);
  a->Free(3);
  a->Free(2);
  EXPECT_EQ(a->used(), 0);
  // The whole arena is one free range again.
  EXPECT_TRUE(a->Allocate(4, 4096));
}

}  // namespace
}  // namespace deltad::sim
