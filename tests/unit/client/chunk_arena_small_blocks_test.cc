// Small allocations: blocks of a size class sharing a chunk, and the empty
// pages kept mapped for the next.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "client/chunk_arena.h"
#include "gtest/gtest.h"
#include "tests/unit/client/chunk_arena_test_helpers.h"

namespace deltad::client {
namespace {

using absl::StatusCode;

TEST(ChunkArena, SmallAllocationsShareAChunkAlignedAndApart) {
  SimSetup s(1);
  const int64_t bytes = 1000;  // served by 1 KiB blocks: 64 to a chunk
  std::vector<unsigned char*> blocks;
  for (int i = 0; i < kChunk / 1024; ++i) {
    auto p = s.arena->Allocate(bytes);
    ASSERT_TRUE(p.ok()) << i << ": " << p.status();
    blocks.push_back(static_cast<unsigned char*>(*p));
    std::memset(*p, i, bytes);
  }
  EXPECT_EQ(s.arena->free_bytes(), 0);
  EXPECT_EQ(s.arena->allocated_bytes(), 64 * bytes);
  EXPECT_EQ(s.arena->Allocate(bytes).status().code(),
            StatusCode::kResourceExhausted);

  std::vector<unsigned char*> sorted = blocks;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(sorted[i]) % 256, 0u);
    if (i > 0) {
      EXPECT_GE(sorted[i] - sorted[i - 1], bytes);
    }
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(blocks[i][0], static_cast<unsigned char>(i));
    EXPECT_EQ(blocks[i][bytes - 1], static_cast<unsigned char>(i));
  }
  // All of them lie in the one chunk's memfd.
  const std::vector<unsigned char> contents = s.Contents(0);
  const uintptr_t page = reinterpret_cast<uintptr_t>(sorted[0]);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const uintptr_t offset = reinterpret_cast<uintptr_t>(blocks[i]) - page;
    ASSERT_LT(offset, static_cast<uintptr_t>(kChunk));
    EXPECT_EQ(contents[offset], static_cast<unsigned char>(i));
  }
  for (unsigned char* b : blocks) s.arena->Free(b, bytes);
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
  EXPECT_EQ(s.arena->free_bytes(), kChunk);
}

TEST(ChunkArena, SizeClassesGetChunksOfTheirOwn) {
  FakeSetup s(4);
  auto a = s.arena->Allocate(300);   // 512-byte blocks
  auto b = s.arena->Allocate(400);   // the same class
  auto c = s.arena->Allocate(5000);  // 5 KiB blocks
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(s.mapper.map_calls.size(), 2u);
  EXPECT_EQ(static_cast<char*>(*b) - static_cast<char*>(*a), 512);
  EXPECT_EQ(s.arena->free_bytes(), 2 * kChunk);
  s.arena->Free(*a, 300);
  s.arena->Free(*b, 400);
  s.arena->Free(*c, 5000);
}

TEST(ChunkArena, AChunkWhoseBlocksAreAllFreedCountsAsFreeAndServesALargeOne) {
  FakeSetup s(2);
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) {
    auto p = s.arena->Allocate(256);
    ASSERT_TRUE(p.ok()) << p.status();
    blocks.push_back(*p);
  }
  EXPECT_EQ(s.mapper.mapped.size(), 1u);
  EXPECT_EQ(s.arena->free_bytes(), kChunk);
  s.arena->Free(blocks[0], 256);
  s.arena->Free(blocks[2], 256);
  EXPECT_EQ(s.mapper.mapped.size(), 1u);
  EXPECT_EQ(s.arena->free_bytes(), kChunk);
  s.arena->Free(blocks[1], 256);
  // Kept mapped for the next block of its class, but free all the same.
  EXPECT_EQ(s.mapper.mapped.size(), 1u);
  EXPECT_EQ(s.arena->free_bytes(), 2 * kChunk);
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
  // Both chunks now serve one large allocation: the empty page is unmapped.
  auto big = s.arena->Allocate(2 * kChunk);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(s.mapper.mapped.size(), 2u);
  s.arena->Free(*big, 2 * kChunk);
}

TEST(ChunkArena, AnAllocateAndFreePairOfOneSmallBlockMapsNothingAfterTheFirst) {
  FakeSetup s(4);
  auto first = s.arena->Allocate(512);
  ASSERT_TRUE(first.ok()) << first.status();
  s.arena->Free(*first, 512);
  const size_t maps = s.mapper.map_calls.size();
  const int unmaps = s.mapper.unmap_calls;
  for (int i = 0; i < 100; ++i) {
    auto p = s.arena->Allocate(512);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(*p, *first);
    s.arena->Free(*p, 512);
  }
  EXPECT_EQ(s.mapper.map_calls.size(), maps);
  EXPECT_EQ(s.mapper.unmap_calls, unmaps);
}

TEST(ChunkArena, OnlyOneEmptyPagePerSizeClassStaysMapped) {
  FakeSetup s(4);
  const int64_t per_page = kChunk / 512;
  std::vector<void*> blocks;
  for (int64_t i = 0; i < per_page + 1; ++i) {  // two pages of one class
    auto p = s.arena->Allocate(512);
    ASSERT_TRUE(p.ok()) << p.status();
    blocks.push_back(*p);
  }
  auto other = s.arena->Allocate(5000);  // a third page, another class
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_EQ(s.mapper.mapped.size(), 3u);
  for (void* p : blocks) s.arena->Free(p, 512);
  s.arena->Free(*other, 5000);
  // One empty page of each class stays; the second of the first class went.
  EXPECT_EQ(s.mapper.mapped.size(), 2u);
  EXPECT_EQ(s.arena->free_bytes(), 4 * kChunk);
  // Released when asked, although mapped (the mapper checks the order).
  EXPECT_EQ(s.arena->ShrinkTo(0).size(), 4u);
  EXPECT_TRUE(s.mapper.mapped.empty());
  EXPECT_EQ(s.arena->held_bytes(), 0);
}

}  // namespace
}  // namespace deltad::client
