// Creating a ChunkArena, and large allocations: runs of whole chunks mapped
// side by side, kept mapped when freed and taken again.

#include "client/chunk_arena.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tests/unit/client/chunk_arena_test_helpers.h"

namespace deltad::client {
namespace {

using absl::StatusCode;

unsigned char Pattern(int64_t offset, int seed) {
  return static_cast<unsigned char>((offset * 131 + offset / 4093 + seed) &
                                    0xff);
}

TEST(ChunkArena, CreateReservesTwiceTheMaximumInWholeAlignedChunks) {
  FakeMapper mapper;
  auto arena = ChunkArena::Create(mapper, kChunk, 5 * kChunk + 1);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ(mapper.reserved_bytes, 12 * kChunk);
  EXPECT_EQ(mapper.reserved_alignment, kChunk);
  EXPECT_EQ((*arena)->base(), FakeMapper::kBase);
  EXPECT_EQ((*arena)->reserved_bytes(), 12 * kChunk);
  EXPECT_EQ((*arena)->held_bytes(), 0);
}

TEST(ChunkArena, CreateRejectsSizesThatCannotWork) {
  FakeMapper mapper;
  EXPECT_EQ(ChunkArena::Create(mapper, 0, kChunk).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkArena::Create(mapper, kChunk, 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkArena::Create(mapper, kChunk, kChunk - 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      ChunkArena::Create(mapper, kChunk + 100, 4 * kChunk).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(mapper.reserved_bytes, 0);
}

TEST(ChunkArena, LargeAllocationMapsWholeChunksSideBySide) {
  FakeSetup s(4);
  const int64_t bytes = 2 * kChunk + kChunk / 2;
  auto p = s.arena->Allocate(bytes);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(s.mapper.map_calls.size(), 3u);
  const uintptr_t start = reinterpret_cast<uintptr_t>(*p);
  EXPECT_EQ((start - s.arena->base()) % kChunk, 0u);
  std::set<uint64_t> handles;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.mapper.mapped.count(start + static_cast<uintptr_t>(i * kChunk)),
              1u);
    handles.insert(s.mapper.map_calls[static_cast<size_t>(i)].first);
  }
  EXPECT_EQ(handles.size(), 3u);
  EXPECT_EQ(s.arena->free_bytes(), kChunk);
  EXPECT_EQ(s.arena->allocated_bytes(), bytes);

  // Freed, its chunks stay mapped for the next of its size, and count as
  // free.
  s.arena->Free(*p, bytes);
  EXPECT_EQ(s.mapper.mapped.size(), 3u);
  EXPECT_EQ(s.arena->free_bytes(), 4 * kChunk);
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
}

TEST(ChunkArena, AFreedRunIsTakenAgainAsItLiesByTheNextOfItsChunkCount) {
  FakeSetup s(4);
  auto p = s.arena->Allocate(2 * kChunk);
  ASSERT_TRUE(p.ok()) << p.status();
  s.arena->Free(*p, 2 * kChunk);
  const size_t maps = s.mapper.map_calls.size();
  const int unmaps = s.mapper.unmap_calls;
  // Another size of the same chunk count: same place, no mapping.
  auto again = s.arena->Allocate(2 * kChunk - 100);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *p);
  EXPECT_EQ(s.mapper.map_calls.size(), maps);
  EXPECT_EQ(s.mapper.unmap_calls, unmaps);
  EXPECT_EQ(s.arena->allocated_bytes(), 2 * kChunk - 100);
  EXPECT_EQ(s.arena->free_bytes(), 2 * kChunk);
  s.arena->Free(*again, 2 * kChunk - 100);
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
}

TEST(ChunkArena, KeptChunksAreUnmappedForAnAllocationThatNeedsThem) {
  FakeSetup s(4);
  auto two = s.arena->Allocate(2 * kChunk);
  auto one = s.arena->Allocate(kChunk);
  ASSERT_TRUE(two.ok() && one.ok());
  s.arena->Free(*two, 2 * kChunk);
  s.arena->Free(*one, kChunk);
  EXPECT_EQ(s.mapper.mapped.size(), 3u);
  // Four chunks at once: only one is unmapped, so both kept runs go.
  auto four = s.arena->Allocate(4 * kChunk);
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(s.mapper.mapped.size(), 4u);
  EXPECT_EQ(s.arena->free_bytes(), 0);
  s.arena->Free(*four, 4 * kChunk);
  // A page of small blocks takes a kept chunk too.
  auto small = s.arena->Allocate(1000);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(s.arena->free_bytes(), 3 * kChunk);
  s.arena->Free(*small, 1000);
  // And nothing is left over that is not free.
  EXPECT_EQ(s.arena->free_bytes(), 4 * kChunk);
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
}

TEST(ChunkArena, BytesWrittenToALargeAllocationReachItsChunks) {
  SimSetup s(4);
  const int64_t bytes = 3 * kChunk;
  auto p = s.arena->Allocate(bytes);
  ASSERT_TRUE(p.ok()) << p.status();
  auto* data = static_cast<unsigned char*>(*p);
  for (int64_t i = 0; i < bytes; ++i) data[i] = Pattern(i, 1);

  // Each third of the allocation is in one memfd, whole; the fourth memfd
  // is untouched.
  std::vector<bool> piece_found(3, false);
  int untouched = 0;
  for (int chunk = 0; chunk < 4; ++chunk) {
    const std::vector<unsigned char> contents = s.Contents(chunk);
    if (std::all_of(contents.begin(), contents.end(),
                    [](unsigned char c) { return c == 0; })) {
      ++untouched;
      continue;
    }
    bool matched = false;
    for (int piece = 0; piece < 3; ++piece) {
      if (std::memcmp(contents.data(), data + piece * kChunk, kChunk) == 0) {
        EXPECT_FALSE(piece_found[static_cast<size_t>(piece)]);
        piece_found[static_cast<size_t>(piece)] = true;
        matched = true;
      }
    }
    EXPECT_TRUE(matched) << "memfd " << chunk << " holds none of the pieces";
  }
  EXPECT_EQ(untouched, 1);
  EXPECT_TRUE(piece_found[0] && piece_found[1] && piece_found[2]);
  s.arena->Free(*p, bytes);
}

TEST(ChunkArena, ChunksFreedOutOfOrderServeALargerAllocation) {
  SimSetup s(4);
  std::vector<unsigned char*> one(4);
  for (int i = 0; i < 4; ++i) {
    auto p = s.arena->Allocate(kChunk);
    ASSERT_TRUE(p.ok()) << p.status();
    one[static_cast<size_t>(i)] = static_cast<unsigned char*>(*p);
    std::memset(*p, 10 + i, kChunk);
  }
  EXPECT_EQ(s.arena->free_bytes(), 0);
  s.arena->Free(one[1], kChunk);
  s.arena->Free(one[3], kChunk);

  auto two = s.arena->Allocate(2 * kChunk);
  ASSERT_TRUE(two.ok()) << two.status();
  auto* data = static_cast<unsigned char*>(*two);
  for (int64_t i = 0; i < 2 * kChunk; ++i) data[i] = Pattern(i, 2);
  for (int64_t i = 0; i < 2 * kChunk; ++i) {
    ASSERT_EQ(data[i], Pattern(i, 2)) << i;
  }
  // The survivors kept their bytes.
  EXPECT_EQ(one[0][0], 10);
  EXPECT_EQ(one[0][kChunk - 1], 10);
  EXPECT_EQ(one[2][kChunk / 2], 12);
  EXPECT_EQ(s.arena->free_bytes(), 0);
  EXPECT_EQ(s.arena->allocated_bytes(), 4 * kChunk);
  s.arena->Free(*two, 2 * kChunk);
  s.arena->Free(one[0], kChunk);
  s.arena->Free(one[2], kChunk);
  EXPECT_EQ(s.arena->free_bytes(), 4 * kChunk);
}

}  // namespace
}  // namespace deltad::client
