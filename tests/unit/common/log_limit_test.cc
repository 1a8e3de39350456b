#include "common/log_limit.h"

#include <chrono>

#include "gtest/gtest.h"

namespace deltad::common {
namespace {

using std::chrono::milliseconds;

TEST(LogLimit, LetsABurstThroughThenHoldsBackUntilTheWindowEnds) {
  LogLimit limit(2, milliseconds(1000));
  const auto t0 = LogLimit::Clock::time_point{} + std::chrono::hours(1);
  int64_t held = -1;
  EXPECT_TRUE(limit.AllowAt(t0, &held));
  EXPECT_EQ(held, 0);
  EXPECT_TRUE(limit.AllowAt(t0 + milliseconds(10), &held));
  EXPECT_FALSE(limit.AllowAt(t0 + milliseconds(20), &held));
  EXPECT_FALSE(limit.AllowAt(t0 + milliseconds(999), &held));
  // The next line let through says how many were held back.
  EXPECT_TRUE(limit.AllowAt(t0 + milliseconds(1000), &held));
  EXPECT_EQ(held, 2);
  EXPECT_TRUE(limit.AllowAt(t0 + milliseconds(1001), &held));
  EXPECT_EQ(held, 0);
}

}  // namespace
}  // namespace deltad::common
