#include "client/chunk_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "client/sim_chunk_mapper.h"
#include "gtest/gtest.h"

namespace deltad::client {
namespace {

using absl::StatusCode;

// Records what the arena asks of it, maps nothing, and fails on request.
class FakeMapper : public ChunkMapper {
 public:
  static constexpr uintptr_t kBase = uintptr_t{1} << 44;

  absl::StatusOr<uintptr_t> Reserve(int64_t bytes, int64_t alignment) override {
    reserved_bytes = bytes;
    reserved_alignment = alignment;
    return kBase;
  }
  void Unreserve(uintptr_t base, int64_t bytes) override {
    unreserved.emplace_back(base, bytes);
  }
  absl::StatusOr<uint64_t> Import(int fd, int64_t bytes) override {
    (void)bytes;
    const uint64_t handle = next_handle++;
    live_handles.insert(handle);
    fd_of_handle[handle] = fd;
    return handle;
  }
  absl::Status Map(uint64_t handle, uintptr_t at, int64_t bytes) override {
    if (maps_before_failure == 0) {
      return absl::InternalError("told to fail this Map");
    }
    if (maps_before_failure > 0) --maps_before_failure;
    EXPECT_EQ(bytes, chunk_bytes);
    EXPECT_TRUE(live_handles.contains(handle));
    EXPECT_FALSE(mapped.contains(at)) << "mapped twice at " << at;
    for (const auto& [where, h] : mapped) {
      EXPECT_NE(h, handle) << "one chunk mapped at two places";
    }
    mapped[at] = handle;
    map_calls.emplace_back(handle, at);
    return absl::OkStatus();
  }
  absl::Status Unmap(uintptr_t at, int64_t bytes) override {
    EXPECT_EQ(bytes, chunk_bytes);
    ++unmap_calls;
    if (fail_unmaps) return absl::InternalError("told to fail this Unmap");
    EXPECT_EQ(mapped.erase(at), 1u) << "unmapped what was not mapped";
    return absl::OkStatus();
  }
  void Release(uint64_t handle) override {
    EXPECT_FALSE(mapped_handle(handle)) << "released while mapped";
    EXPECT_EQ(live_handles.erase(handle), 1u);
    released.push_back(handle);
  }

  bool mapped_handle(uint64_t handle) const {
    for (const auto& [at, h] : mapped) {
      if (h == handle) return true;
    }
    return false;
  }

  int64_t chunk_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t reserved_alignment = 0;
  uint64_t next_handle = 100;
  std::set<uint64_t> live_handles;
  std::map<uint64_t, int> fd_of_handle;
  std::map<uintptr_t, uint64_t> mapped;  // address -> handle
  std::vector<std::pair<uint64_t, uintptr_t>> map_calls;
  int unmap_calls = 0;
  std::vector<uint64_t> released;
  std::vector<std::pair<uintptr_t, int64_t>> unreserved;
  int maps_before_failure = -1;  // -1: never fail
  bool fail_unmaps = false;
};

constexpr int64_t kChunk = 64 << 10;

// An arena over a FakeMapper holding `chunks` chunks with ids 0, 1, ...
// The fake mapper never reads the descriptors, so they are made up.
struct FakeSetup {
  explicit FakeSetup(int chunks, int64_t max_bytes = 16 * kChunk) {
    mapper.chunk_bytes = kChunk;
    auto created = ChunkArena::Create(mapper, kChunk, max_bytes);
    EXPECT_TRUE(created.ok()) << created.status();
    arena = *std::move(created);
    for (int i = 0; i < chunks; ++i) {
      EXPECT_TRUE(
          arena->AddChunk(static_cast<uint64_t>(i), 1000 + i, kChunk).ok());
    }
  }
  FakeMapper mapper;
  std::unique_ptr<ChunkArena> arena;
};

int Memfd(int64_t bytes) {
  const int fd = ::memfd_create("chunk-arena-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, bytes), 0);
  return fd;
}

// An arena over memfd chunks; the test keeps its descriptors to read what
// reached each chunk.
struct SimSetup {
  explicit SimSetup(int chunks, int64_t max_bytes = 64 * kChunk) {
    auto created = ChunkArena::Create(mapper, kChunk, max_bytes);
    EXPECT_TRUE(created.ok()) << created.status();
    arena = *std::move(created);
    for (int i = 0; i < chunks; ++i) {
      fds.push_back(Memfd(kChunk));
      EXPECT_TRUE(
          arena->AddChunk(static_cast<uint64_t>(i), fds.back(), kChunk).ok());
    }
  }
  ~SimSetup() {
    arena.reset();
    for (int fd : fds) ::close(fd);
  }
  std::vector<unsigned char> Contents(int chunk) const {
    std::vector<unsigned char> bytes(kChunk);
    EXPECT_EQ(::pread(fds[static_cast<size_t>(chunk)], bytes.data(), kChunk, 0),
              kChunk);
    return bytes;
  }
  SimChunkMapper mapper;
  std::unique_ptr<ChunkArena> arena;
  std::vector<int> fds;
};

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

TEST(ChunkArena, ConcurrentAllocationsKeepTheirBytes) {
  SimSetup s(48);
  constexpr int kThreads = 4;
  constexpr int kRounds = 1000;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  // Per thread, how many small and large allocations succeeded.
  std::vector<int> small_ok(kThreads, 0);
  std::vector<int> large_ok(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t) + 1);
      std::uniform_int_distribution<int64_t> small(1, kChunk / 2 - 1);
      std::uniform_int_distribution<int64_t> large(kChunk / 2, 3 * kChunk);
      struct Live {
        unsigned char* data;
        int64_t bytes;
        unsigned char tag;
      };
      std::vector<Live> live;
      auto check_and_free = [&](size_t i) {
        const auto [p, bytes, tag] = live[i];
        for (int64_t j = 0; j < bytes; j += 97) {
          if (p[j] != tag) ++failures[static_cast<size_t>(t)];
        }
        if (p[bytes - 1] != tag) ++failures[static_cast<size_t>(t)];
        s.arena->Free(p, bytes);
        live[i] = live.back();
        live.pop_back();
      };
      for (int round = 0; round < kRounds; ++round) {
        const int64_t bytes = rng() % 4 == 0 ? large(rng) : small(rng);
        auto p = s.arena->Allocate(bytes);
        if (p.ok()) {
          auto* data = static_cast<unsigned char*>(*p);
          const auto tag = static_cast<unsigned char>(rng());
          std::memset(data, tag, static_cast<size_t>(bytes));
          live.push_back(Live{data, bytes, tag});
          ++(bytes < kChunk / 2 ? small_ok : large_ok)[static_cast<size_t>(t)];
        } else if (p.status().code() != StatusCode::kResourceExhausted) {
          ++failures[static_cast<size_t>(t)];
        }
        if (!live.empty() && (live.size() >= 6 || rng() % 2 == 0 || !p.ok())) {
          check_and_free(rng() % live.size());
        }
      }
      while (!live.empty()) check_and_free(live.size() - 1);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (size_t t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], 0) << t;
    EXPECT_GT(small_ok[t], 0) << t;
    EXPECT_GT(large_ok[t], 0) << t;
  }
  EXPECT_EQ(s.arena->allocated_bytes(), 0);
  EXPECT_EQ(s.arena->free_bytes(), 48 * kChunk);
}

}  // namespace
}  // namespace deltad::client
