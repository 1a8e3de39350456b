// When the daemon gives freed heap back to the system.
#include "daemon/heap_return.h"

#include <cstdint>
#include <cstdlib>

#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

constexpr int64_t kSecond = 1000000000;
constexpr int64_t kMiB = int64_t{1} << 20;

class HeapReturnTest : public ::testing::Test {
 protected:
  HeapReturn heap_{{.interval_ns = 10 * kSecond,
                    .min_free_bytes = 16 * kMiB,
                    .urgent_free_bytes = 256 * kMiB},
                   [this] { return free_; },
                   [this] {
                     ++trimmed_;
                     free_ = 0;
                   }};
  int64_t free_ = 0;
  int trimmed_ = 0;
};

TEST_F(HeapReturnTest, TrimsOnlyWhenEnoughLiesFree) {
  free_ = 15 * kMiB;
  EXPECT_FALSE(heap_.Tick(0));
  EXPECT_EQ(trimmed_, 0);
  free_ = 40 * kMiB;
  EXPECT_TRUE(heap_.Tick(10 * kSecond));
  EXPECT_EQ(trimmed_, 1);
  EXPECT_EQ(heap_.trims(), 1);
  EXPECT_EQ(heap_.offered_bytes(), 40 * kMiB);
}

TEST_F(HeapReturnTest, TrimsAtMostOncePerIntervalUnlessMuchLiesFree) {
  free_ = 40 * kMiB;
  EXPECT_TRUE(heap_.Tick(5 * kSecond));
  free_ = 40 * kMiB;
  EXPECT_FALSE(heap_.Tick(14 * kSecond));  // 9 s later
  EXPECT_TRUE(heap_.Tick(15 * kSecond));
  EXPECT_EQ(trimmed_, 2);
  // A sudden mass of freed memory is not left for the interval.
  free_ = 300 * kMiB;
  EXPECT_TRUE(heap_.Tick(15 * kSecond + 100000000));
  EXPECT_EQ(trimmed_, 3);
}

#if defined(__GLIBC__)
TEST(LimitHeapArenasTest, TheEnvironmentWinsOverTheConfiguredCap) {
  ASSERT_EQ(setenv("MALLOC_ARENA_MAX", "3", 1), 0);
  EXPECT_EQ(LimitHeapArenas(2), 3);
  ASSERT_EQ(unsetenv("MALLOC_ARENA_MAX"), 0);
  const int capped = LimitHeapArenas(2);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitizer's allocator stands in for glibc's, and AddressSanitizer's
  // mallopt refuses: the cap is then not in force, and says so.
  EXPECT_TRUE(capped == 2 || capped == 0) << capped;
#else
  EXPECT_EQ(capped, 2);
#endif
  EXPECT_EQ(LimitHeapArenas(0), 0);  // glibc's default stays
}
#endif

}  // namespace
}  // namespace deltad::daemon
