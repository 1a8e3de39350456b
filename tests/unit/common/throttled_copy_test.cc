#include "common/throttled_copy.h"

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace deltad::common {
namespace {

// --- ThrottledCopy
// --------------------------------------------------------------

std::vector<unsigned char> Pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  std::mt19937 rng(seed);
  for (unsigned char& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

TEST(ThrottledCopy, CopiesTheBytesExactly) {
  // Not a multiple of the piece size, so the last piece is partial.
  const size_t n = 2 * ThrottledCopy::kPieceBytes + 12345;
  const std::vector<unsigned char> src = Pattern(n, 1);
  for (double rate : {0.0, -5.0, 1e12}) {
    std::vector<unsigned char> dst(n + 2, 0xAB);
    ThrottledCopy copy(rate);
    copy.Copy(dst.data() + 1, src.data(), static_cast<int64_t>(n));
    EXPECT_EQ(std::memcmp(dst.data() + 1, src.data(), n), 0) << rate;
    // Nothing written outside the destination.
    EXPECT_EQ(dst.front(), 0xAB) << rate;
    EXPECT_EQ(dst.back(), 0xAB) << rate;
  }
}

TEST(ThrottledCopy, ZeroOrNegativeRateMeansUnthrottled) {
  EXPECT_EQ(ThrottledCopy(0).bytes_per_s(), 0);
  EXPECT_EQ(ThrottledCopy(-1).bytes_per_s(), 0);
  EXPECT_EQ(ThrottledCopy(std::nan("")).bytes_per_s(), 0);
  EXPECT_EQ(ThrottledCopy(25e9).bytes_per_s(), 25e9);
}

TEST(ThrottledCopy, NonPositiveSizeCopiesNothing) {
  unsigned char dst[4] = {1, 2, 3, 4};
  const unsigned char src[4] = {9, 9, 9, 9};
  ThrottledCopy copy(1e6);
  copy.Copy(dst, src, 0);
  copy.Copy(dst, src, -4);
  EXPECT_EQ(dst[0], 1);
  EXPECT_EQ(dst[3], 4);
}

TEST(ThrottledCopy, TwentyMBAt100MBPerSecondTakesAtLeastPointTwoSeconds) {
  const size_t n = 20'000'000;
  const std::vector<unsigned char> src = Pattern(n, 2);
  std::vector<unsigned char> dst(n);
  ThrottledCopy copy(100e6);
  const auto start = std::chrono::steady_clock::now();
  copy.Copy(dst.data(), src.data(), static_cast<int64_t>(n));
  const double seconds = SecondsSince(start);
  // 20 MB / 100 MB/s = 0.2 s; a lower bound only, machines are noisy.
  EXPECT_GE(seconds, 0.199);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), n), 0);
}

TEST(ThrottledCopy, ConcurrentCopiesShareTheRate) {
  const size_t n = 10'000'000;
  const std::vector<unsigned char> src = Pattern(n, 3);
  std::vector<unsigned char> dst_a(n);
  std::vector<unsigned char> dst_b(n);
  ThrottledCopy copy(100e6);
  const auto start = std::chrono::steady_clock::now();
  std::thread a([&] { copy.Copy(dst_a.data(), src.data(), n); });
  std::thread b([&] { copy.Copy(dst_b.data(), src.data(), n); });
  a.join();
  b.join();
  // Two 10 MB copies over one 100 MB/s link: 0.2 s, not 0.1 s.
  EXPECT_GE(SecondsSince(start), 0.199);
  EXPECT_EQ(std::memcmp(dst_a.data(), src.data(), n), 0);
  EXPECT_EQ(std::memcmp(dst_b.data(), src.data(), n), 0);
}

TEST(ThrottledCopy, IdleTimeEarnsNoBurst) {
  const size_t n = 5'000'000;
  const std::vector<unsigned char> src = Pattern(n, 4);
  std::vector<unsigned char> dst(n);
  ThrottledCopy copy(100e6);
  copy.Copy(dst.data(), src.data(), n);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto start = std::chrono::steady_clock::now();
  copy.Copy(dst.data(), src.data(), n);
  // 5 MB at 100 MB/s = 50 ms even right after 100 ms of idle link.
  EXPECT_GE(SecondsSince(start), 0.049);
}

}  // namespace
}  // namespace deltad::common
