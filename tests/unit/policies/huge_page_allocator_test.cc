// Tests of the allocator behind the policy's large arrays: both of its
// paths (operator new under 2 MiB, a mapping of its own from there) hold
// and keep what a vector stores, across growth and release.

#include "policies/huge_page_allocator.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/unit/policies/resident_bytes.h"

namespace deltad::policy {
namespace {

TEST(HugePageAllocatorTest, AVectorGrowingPastTwoMebibytesKeepsItsElements) {
  std::vector<uint64_t, HugePageAllocator<uint64_t>> v;
  // 1 Mi elements: 8 MiB, reached by doubling from small buffers, so the
  // contents move from operator new's memory into mappings and between
  // mappings.
  constexpr uint64_t kCount = uint64_t{1} << 20;
  for (uint64_t i = 0; i < kCount; ++i) v.push_back(i * 2654435761u);
  ASSERT_GE(v.capacity() * sizeof(uint64_t),
            HugePageAllocator<uint64_t>::kHugePageBytes);
  for (uint64_t i = 0; i < kCount; i += 4099) {
    ASSERT_EQ(v[i], i * 2654435761u) << i;
  }
  EXPECT_EQ(v.back(), (kCount - 1) * 2654435761u);
  // Shrinking back under 2 MiB goes through operator new again.
  v.resize(10);
  v.shrink_to_fit();
  EXPECT_EQ(v[9], 9 * uint64_t{2654435761u});
}

TEST(HugePageAllocatorTest,
     AnAllocationOfExactlyTwoMebibytesIsMappedAndUsable) {
  HugePageAllocator<char> alloc;
  const size_t n = HugePageAllocator<char>::kHugePageBytes;
  char* p = alloc.allocate(n);
  ASSERT_NE(p, nullptr);
  // A mapping of its own starts on a page boundary and reads as zeros.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
  EXPECT_EQ(p[0], 0);
  EXPECT_EQ(p[n - 1], 0);
  p[0] = 1;
  p[n - 1] = 2;
  EXPECT_EQ(p[0] + p[n - 1], 3);
  alloc.deallocate(p, n);
}

// A Tensor asks for its cache line: small arrays (from operator new) and
// mapped ones alike start on one, or its scored fields straddle two.
TEST(HugePageAllocatorTest, ArraysAreAlignedAsTheirTypeAsks) {
  struct alignas(64) Line {
    char bytes[64];
  };
  HugePageAllocator<Line> alloc;
  // Held at once, so that each comes from a new place in the heap.
  std::vector<std::pair<Line*, size_t>> held;
  for (size_t n = 1; n <= 40; ++n) held.emplace_back(alloc.allocate(n), n);
  held.emplace_back(alloc.allocate(40000), 40000);  // 2.4 MiB: mapped
  for (auto [p, n] : held) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << n;
  }
  for (auto [p, n] : held) alloc.deallocate(p, n);
}

using testing_util::ResidentBytes;

TEST(HugePageAllocatorTest,
     DiscardingUnusedCapacityGivesItsPagesBackAndKeepsTheElements) {
  constexpr size_t kHuge = HugePageAllocator<uint64_t>::kHugePageBytes;
  std::vector<uint64_t, HugePageAllocator<uint64_t>> v(size_t{2} << 20);
  for (size_t i = 0; i < v.size(); ++i) v[i] = i + 1;
  const uint64_t* data = v.data();
  const size_t capacity_bytes = v.capacity() * sizeof(uint64_t);  // 16 MiB
  ASSERT_GE(ResidentBytes(data, capacity_bytes), capacity_bytes / 2);
  v.resize(1000);
  EXPECT_GE(DiscardUnusedCapacity(v), capacity_bytes - 2 * kHuge);
  // What holds the 1000 elements stays: at most the two huge pages around
  // them (the mapping need not start on one).
  EXPECT_LE(ResidentBytes(data, capacity_bytes), 2 * kHuge);
  EXPECT_EQ(v.data(), data);
  EXPECT_EQ(v.capacity() * sizeof(uint64_t), capacity_bytes);
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], i + 1) << i;
  // Growing again within the capacity uses the discarded pages anew.
  for (size_t i = v.size(); i < (size_t{2} << 20); ++i) v.push_back(~i);
  EXPECT_EQ(v.data(), data);
  EXPECT_EQ(v[999], 1000u);
  EXPECT_EQ(v.back(), ~((size_t{2} << 20) - 1));
}

TEST(HugePageAllocatorTest, SmallArraysAreNotDiscarded) {
  std::vector<uint64_t, HugePageAllocator<uint64_t>> v(1000, 7);
  v.resize(10);
  EXPECT_EQ(DiscardUnusedCapacity(v), 0u);
  EXPECT_EQ(v[9], 7u);
}

TEST(HugePageAllocatorTest, AnImpossibleSizeThrowsInsteadOfWrapping) {
  HugePageAllocator<uint64_t> alloc;
  EXPECT_THROW(alloc.allocate(SIZE_MAX / 4), std::bad_array_new_length);
}

}  // namespace
}  // namespace deltad::policy
