// A ChunkArena running out, handed pointers it never gave, and over a
// mapper that fails: nothing is lost.

#include <cstdint>

#include "absl/status/status.h"
#include "client/chunk_arena.h"
#include "gtest/gtest.h"
#include "tests/unit/client/chunk_arena_test_helpers.h"

namespace deltad::client {
namespace {

using absl::StatusCode;

TEST(ChunkArena, RunningOutLeavesTheFreeListAsItWas) {
  FakeSetup s(2);
  EXPECT_EQ(s.arena->Allocate(3 * kChunk).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(s.arena->free_bytes(), 2 * kChunk);
  auto all = s.arena->Allocate(2 * kChunk);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(s.arena->Allocate(100).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(s.arena->Allocate(kChunk).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(s.arena->free_bytes(), 0);
  EXPECT_EQ(s.arena->allocated_bytes(), 2 * kChunk);
  EXPECT_EQ(s.arena->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.arena->Allocate(-1).status().code(),
            StatusCode::kInvalidArgument);
  s.arena->Free(*all, 2 * kChunk);
}

TEST(ChunkArena, FreeIgnoresPointersItDidNotHandOut) {
  FakeSetup s(4);
  auto big = s.arena->Allocate(2 * kChunk);
  auto small = s.arena->Allocate(1000);
  ASSERT_TRUE(big.ok() && small.ok());
  const int64_t allocated = s.arena->allocated_bytes();
  int local = 0;
  char* b = static_cast<char*>(*big);
  char* m = static_cast<char*>(*small);

  s.arena->Free(nullptr, 100);
  s.arena->Free(&local, sizeof(local));
  s.arena->Free(b + 256, 2 * kChunk);  // inside, not the start
  s.arena->Free(b + kChunk, kChunk);   // its second chunk
  s.arena->Free(m + 1024, 1000);       // a block never handed out
  s.arena->Free(m + 8, 1000);          // not a block start
  s.arena->Free(m, 100);               // a size of another class
  s.arena->Free(reinterpret_cast<void*>(s.arena->base() +
                                        s.arena->reserved_bytes() / 2 + 256),
                100);  // inside the range, nothing mapped there
  EXPECT_EQ(s.arena->allocated_bytes(), allocated);
  EXPECT_EQ(s.arena->free_bytes(), kChunk);
  EXPECT_EQ(s.mapper.mapped.size(), 3u);

  s.arena->Free(m, 1000);
  s.arena->Free(m, 1000);  // twice
  s.arena->Free(b, 2 * kChunk);
  s.arena->Free(b, 2 * kChunk);
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
  EXPECT_EQ(s.arena->free_bytes(), 4 * kChunk);
  // The large one and the small one's page, kept.
  EXPECT_EQ(s.mapper.mapped.size(), 3u);
}

TEST(ChunkArena, AMapperFailureWhileAllocatingLosesNoChunk) {
  FakeSetup s(4);
  s.mapper.maps_before_failure = 2;
  auto p = s.arena->Allocate(3 * kChunk);
  EXPECT_EQ(p.status().code(), StatusCode::kInternal);
  EXPECT_TRUE(s.mapper.mapped.empty());
  EXPECT_EQ(s.arena->free_bytes(), 4 * kChunk);
  EXPECT_EQ(s.arena->allocated_bytes(), 0);

  s.mapper.maps_before_failure = 0;
  EXPECT_EQ(s.arena->Allocate(100).status().code(), StatusCode::kInternal);
  EXPECT_EQ(s.arena->free_bytes(), 4 * kChunk);

  // Neither the chunks nor the addresses were lost: the whole arena maps.
  s.mapper.maps_before_failure = -1;
  auto all = s.arena->Allocate(4 * kChunk);
  ASSERT_TRUE(all.ok()) << all.status();
  s.arena->Free(*all, 4 * kChunk);
}

TEST(ChunkArena, AChunkThatCannotBeUnmappedStaysOutOfUseUntilTheEnd) {
  FakeSetup s(2);
  auto p = s.arena->Allocate(kChunk);
  ASSERT_TRUE(p.ok()) << p.status();
  s.mapper.fail_unmaps = true;
  s.arena->Free(*p, kChunk);  // kept mapped
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
  EXPECT_EQ(s.arena->free_bytes(), 2 * kChunk);
  // Releasing it needs an unmap, which fails: it stays, out of use.
  EXPECT_EQ(s.arena->ShrinkTo(0).size(), 1u);
  EXPECT_EQ(s.arena->free_bytes(), 0);
  EXPECT_EQ(s.arena->held_bytes(), kChunk);
  s.mapper.fail_unmaps = false;
  const int unmaps = s.mapper.unmap_calls;
  s.arena.reset();
  EXPECT_EQ(s.mapper.unmap_calls, unmaps + 1);
  EXPECT_TRUE(s.mapper.mapped.empty());
  EXPECT_TRUE(s.mapper.live_handles.empty());
}

}  // namespace
}  // namespace deltad::client
