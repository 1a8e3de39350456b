// The chunks a ChunkArena holds: added, released by ShrinkTo, and all given
// back by the destructor.

#include <cstdint>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "client/chunk_arena.h"
#include "gtest/gtest.h"
#include "tests/unit/client/chunk_arena_test_helpers.h"

namespace deltad::client {
namespace {

using absl::StatusCode;

TEST(ChunkArena, ShrinkToUnmapsKeptChunksToReleaseThem) {
  FakeSetup s(3);
  auto p = s.arena->Allocate(3 * kChunk);
  ASSERT_TRUE(p.ok()) << p.status();
  s.arena->Free(*p, 3 * kChunk);
  EXPECT_EQ(s.mapper.mapped.size(), 3u);
  EXPECT_EQ(s.arena->ShrinkTo(kChunk).size(), 2u);
  EXPECT_EQ(s.arena->held_bytes(), kChunk);
  // The mapper saw no chunk released while mapped (FakeMapper checks).
  EXPECT_TRUE(s.mapper.mapped.empty());
  EXPECT_EQ(s.arena->free_bytes(), kChunk);
}

TEST(ChunkArena, AddChunkRejectsAWrongSizeADuplicateAndChunksPastTheMaximum) {
  FakeSetup s(0, 2 * kChunk);
  EXPECT_EQ(s.arena->AddChunk(1, 5, kChunk / 2).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(s.arena->AddChunk(1, 5, kChunk).ok());
  EXPECT_EQ(s.arena->AddChunk(1, 6, kChunk).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(s.arena->AddChunk(2, 6, kChunk).ok());
  EXPECT_EQ(s.arena->AddChunk(3, 7, kChunk).code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(s.arena->held_bytes(), 2 * kChunk);
  EXPECT_EQ(s.arena->free_bytes(), 2 * kChunk);
  EXPECT_EQ(s.mapper.live_handles.size(), 2u);
}

TEST(ChunkArena, ShrinkToReleasesOnlyFreeChunksAndReturnsTheirIds) {
  FakeSetup s(4);
  auto p = s.arena->Allocate(2 * kChunk);
  ASSERT_TRUE(p.ok()) << p.status();
  std::set<uint64_t> mapped_handles;
  for (const auto& [at, handle] : s.mapper.mapped) {
    mapped_handles.insert(handle);
  }

  EXPECT_TRUE(s.arena->ShrinkTo(4 * kChunk).empty());
  const std::vector<uint64_t> first = s.arena->ShrinkTo(3 * kChunk);
  EXPECT_EQ(first.size(), 1u);
  EXPECT_EQ(s.arena->held_bytes(), 3 * kChunk);
  const std::vector<uint64_t> rest = s.arena->ShrinkTo(0);
  EXPECT_EQ(rest.size(), 1u);  // the other two are in use
  EXPECT_EQ(s.arena->held_bytes(), 2 * kChunk);
  EXPECT_EQ(s.arena->free_bytes(), 0);

  std::set<uint64_t> ids(first.begin(), first.end());
  ids.insert(rest.begin(), rest.end());
  EXPECT_EQ(ids.size(), 2u);
  ASSERT_EQ(s.mapper.released.size(), 2u);
  for (uint64_t handle : s.mapper.released) {
    EXPECT_FALSE(mapped_handles.contains(handle));
    // FakeSetup gave chunk i descriptor 1000 + i.
    const uint64_t id =
        static_cast<uint64_t>(s.mapper.fd_of_handle.at(handle) - 1000);
    EXPECT_TRUE(ids.contains(id)) << id;
  }
  // A released id may come back.
  EXPECT_TRUE(s.arena->AddChunk(first[0], 2000, kChunk).ok());
  s.arena->Free(*p, 2 * kChunk);
}

TEST(ChunkArena, DestructorUnmapsAndReleasesEverythingAndUnreserves) {
  FakeSetup s(5);
  ASSERT_TRUE(s.arena->Allocate(2 * kChunk).ok());
  ASSERT_TRUE(s.arena->Allocate(300).ok());
  ASSERT_TRUE(s.arena->Allocate(3000).ok());
  EXPECT_EQ(s.mapper.mapped.size(), 4u);
  const uintptr_t base = s.arena->base();
  const int64_t reserved = s.arena->reserved_bytes();
  s.arena.reset();
  EXPECT_TRUE(s.mapper.mapped.empty());
  EXPECT_TRUE(s.mapper.live_handles.empty());
  EXPECT_EQ(s.mapper.released.size(), 5u);
  ASSERT_EQ(s.mapper.unreserved.size(), 1u);
  EXPECT_EQ(s.mapper.unreserved[0].first, base);
  EXPECT_EQ(s.mapper.unreserved[0].second, reserved);
}

}  // namespace
}  // namespace deltad::client
