#include "policies/watermarks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace deltad::policy {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Watermarks Make(double high, double low) {
  absl::StatusOr<Watermarks> w = Watermarks::Create(high, low);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *w : *Watermarks::Create();
}

int64_t Free(const Watermarks& w, int64_t used, int64_t incoming,
             int64_t budget) {
  absl::StatusOr<int64_t> r = w.BytesToFree(used, incoming, budget);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : -1;
}

bool MessageHas(const absl::Status& s, const std::string& part) {
  return std::string(s.message()).find(part) != std::string::npos;
}

// --- Create
// ---------------------------------------------------------------------

TEST(Watermarks, CreateDefaultsToThreeQuartersAndLow) {
  absl::StatusOr<Watermarks> w = Watermarks::Create();
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->high(), 0.75);
  EXPECT_EQ(w->low(), 0.65);
}

TEST(Watermarks, CreateAcceptsBoundaryValues) {
  for (auto [high, low] : {std::pair{1.0, 1.0}, std::pair{0.5, 0.5},
                           std::pair{1.0, 1e-9}, std::pair{0.9, 0.1}}) {
    absl::StatusOr<Watermarks> w = Watermarks::Create(high, low);
    ASSERT_TRUE(w.ok()) << high << " " << low << ": " << w.status();
    EXPECT_EQ(w->high(), high);
    EXPECT_EQ(w->low(), low);
  }
}

TEST(Watermarks, CreateRejectsInvalidMarks) {
  struct Case {
    double high;
    double low;
    const char* why;
  };
  for (const Case& c :
       {Case{0.5, 0.6, "low above high"}, Case{1.01, 0.5, "high above 1"},
        Case{2.0, 2.0, "both above 1"}, Case{0.5, 0.0, "low zero"},
        Case{0.5, -0.1, "low negative"}, Case{0.0, 0.0, "both zero"},
        Case{-0.5, -0.6, "both negative"}, Case{kNaN, 0.5, "high NaN"},
        Case{0.75, kNaN, "low NaN"}}) {
    SCOPED_TRACE(c.why);
    absl::StatusOr<Watermarks> w = Watermarks::Create(c.high, c.low);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(MessageHas(w.status(), "0 < low <= high <= 1")) << w.status();
  }
}

// --- BytesToFree
// -------------------------------------------------------------------

TEST(Watermarks, BytesToFreeIsZeroUpToHighMark) {
  const Watermarks w = Make(0.75, 0.5);
  EXPECT_EQ(Free(w, 0, 0, 1000), 0);
  EXPECT_EQ(Free(w, 700, 0, 1000), 0);
  EXPECT_EQ(Free(w, 700, 50, 1000), 0);  // exactly at the mark
  EXPECT_EQ(Free(w, 750, 0, 1000), 0);
  EXPECT_EQ(Free(w, 0, 750, 1000), 0);
}

TEST(Watermarks, BytesToFreeDrainsToLowMarkAboveHigh) {
  const Watermarks w = Make(0.75, 0.5);
  EXPECT_EQ(Free(w, 751, 0, 1000), 251);
  EXPECT_EQ(Free(w, 700, 51, 1000), 251);
  EXPECT_EQ(Free(w, 800, 100, 1000), 400);
  EXPECT_EQ(Free(w, 1000, 0, 1000), 500);
  // Used may already exceed the budget (e.g. releases in flight).
  EXPECT_EQ(Free(w, 1200, 0, 1000), 700);
}

TEST(Watermarks, DefaultMarksTriggerAtThreeQuarters) {
  const Watermarks w = Make(Watermarks::kDefaultHigh, Watermarks::kDefaultLow);
  const int64_t gib = int64_t{1} << 30;
  const int64_t budget = 40 * gib;
  EXPECT_EQ(Free(w, 30 * gib, 0, budget), 0);
  const int64_t r = Free(w, 30 * gib, gib, budget);
  const auto low_bytes =
      static_cast<int64_t>(std::floor(0.65 * static_cast<double>(budget)));
  EXPECT_EQ(r, 31 * gib - low_bytes);
  EXPECT_EQ(Free(w, 800, 0, 1000), 150);
}

TEST(Watermarks, BytesToFreeNeverExceedsUsed) {
  const Watermarks w = Make(0.75, 0.5);
  // A large allocation overshoots the low mark on its own.
  EXPECT_EQ(Free(w, 100, 900, 1000), 100);
  EXPECT_EQ(Free(w, 300, 700, 1000), 300);  // the low mark would need 500
  EXPECT_EQ(Free(w, 500, 1000, 1000), 500);
  EXPECT_EQ(Free(w, 0, 1000, 1000), 0);
  EXPECT_EQ(Free(w, 0, 800, 1000), 0);
}

TEST(Watermarks, BytesToFreeAtLeastMakesAllocationFit) {
  // With both marks at 1 the low mark gives no slack: exactly the overflow.
  const Watermarks w = Make(1.0, 1.0);
  EXPECT_EQ(Free(w, 1000, 0, 1000), 0);
  EXPECT_EQ(Free(w, 900, 200, 1000), 100);
  EXPECT_EQ(Free(w, 999, 2, 1000), 1);
  EXPECT_EQ(Free(w, 1000, 1000, 1000), 1000);
}

TEST(Watermarks, BytesToFreeRejectsBudgetOfZeroOrLess) {
  const Watermarks w = Make(0.75, 0.5);
  for (int64_t budget : {int64_t{0}, int64_t{-1}, int64_t{-1000}}) {
    absl::StatusOr<int64_t> r = w.BytesToFree(10, 10, budget);
    ASSERT_FALSE(r.ok()) << budget;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(MessageHas(r.status(), "budget must be positive"))
        << r.status();
  }
}

TEST(Watermarks, BytesToFreeRejectsNegativeFigures) {
  const Watermarks w = Make(0.75, 0.5);
  for (auto [used, incoming] :
       {std::pair<int64_t, int64_t>{-1, 0}, std::pair<int64_t, int64_t>{0, -1},
        std::pair<int64_t, int64_t>{-5, -5}}) {
    absl::StatusOr<int64_t> r = w.BytesToFree(used, incoming, 1000);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(MessageHas(r.status(), "negative")) << r.status();
  }
}

TEST(Watermarks, BytesToFreeRejectsAllocationLargerThanBudget) {
  const Watermarks w = Make(0.75, 0.5);
  absl::StatusOr<int64_t> r = w.BytesToFree(0, 1001, 1000);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(MessageHas(r.status(), "1001")) << r.status();
  EXPECT_TRUE(MessageHas(r.status(), "1000")) << r.status();
  EXPECT_EQ(w.BytesToFree(900, 5000, 1000).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// For any valid input: nothing below the high mark; above it, what is left
// (used - freed + incoming) is the low mark, or just the allocation when that
// alone is larger; never more than used is freed; the allocation always fits.
TEST(Watermarks, BytesToFreeLandsOnLowMarkForRandomInputs) {
  std::mt19937_64 rng(7);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int i = 0; i < 20000; ++i) {
    const double high = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
    const double low = std::uniform_real_distribution<double>(0.01, high)(rng);
    const Watermarks w = Make(high, low);
    const int64_t budget = uniform(1, int64_t{1} << 40);
    const int64_t used = uniform(0, 2 * budget);
    const int64_t incoming = uniform(0, budget);
    SCOPED_TRACE(testing::Message()
                 << "high=" << high << " low=" << low << " budget=" << budget
                 << " used=" << used << " incoming=" << incoming);
    const int64_t r = Free(w, used, incoming, budget);
    ASSERT_GE(r, 0);
    ASSERT_LE(r, used);
    const int64_t left = used - r + incoming;
    ASSERT_LE(left, budget);
    const double want = static_cast<double>(used + incoming);
    if (want <= high * static_cast<double>(budget)) {
      ASSERT_EQ(r, 0);
    } else {
      const auto low_bytes =
          static_cast<int64_t>(std::floor(low * static_cast<double>(budget)));
      ASSERT_EQ(left, std::max(low_bytes, incoming));
    }
  }
}

}  // namespace
}  // namespace deltad::policy
