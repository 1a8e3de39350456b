// Tests of Filter::SelectByNextUse: the Filter with a recorded iteration's
// next uses standing in for staleness.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/filter.h"
#include "policies/heuristic.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/filter_test_helpers.h"

namespace deltad::policy {
namespace {

constexpr int64_t kNow = 100000;

// Sizes, costs, access times, one parent each, every seventh evicted.
void Fill(TensorTable& table, int n) {
  TestLcg next(77);
  for (TensorId id = 1; id <= static_cast<TensorId>(n); ++id) {
    std::vector<TensorId> parents;
    if (id > 1 && next() % 2 == 0) parents.push_back(1 + next() % (id - 1));
    AddAt(table,
          Spec(id, 1 + static_cast<int64_t>(next() % 4000),
               static_cast<int64_t>(next() % 5000), parents),
          static_cast<int64_t>(next() % kNow));
  }
  for (TensorId id = 7; id <= static_cast<TensorId>(n); id += 7) {
    Evict(table, id);
  }
}

// A distance for each tensor: up to 500 accesses, one in nine not used.
int64_t DistanceOf(const Tensor& t) {
  const uint64_t h = t.id * 0x9e3779b97f4a7c15ULL;
  return (h >> 60) % 9 == 0 ? -1 : 1 + static_cast<int64_t>((h >> 20) % 500);
}

// What it must pick: the first in list order of the lowest scores, each
// the heuristic's score with the distance for staleness, a tensor not
// used scoring below all.
uint32_t Expected(const Filter& filter, const TensorTable& table,
                  Filter::Eligible eligible) {
  uint32_t want = UINT32_MAX;
  double want_score = 0;
  for (uint32_t slot : table.Candidates(kGpu0)) {
    const Tensor& t = table.AtSlot(slot);
    if (!eligible(t)) continue;
    const int64_t d = DistanceOf(t);
    const double s = d < 0 ? -1.0
                           : Score(filter.options().heuristic, {}, table, slot,
                                   t.last_access_ns + d, nullptr);
    if (want == UINT32_MAX || s < want_score) {
      want = slot;
      want_score = s;
    }
  }
  return want;
}

TEST(FilterNextUseTest, PicksTheLowestScoreWithTheDistanceForStaleness) {
  TensorTable table;
  Fill(table, 300);
  for (Heuristic h : {Heuristic::kDelta, Heuristic::kLru, Heuristic::kDtr,
                      Heuristic::kDtrEq, Heuristic::kDeltaCost}) {
    Filter filter(Options(h));
    std::vector<TensorId> taken;
    auto eligible = [&taken](const Tensor& t) {
      return std::find(taken.begin(), taken.end(), t.id) == taken.end();
    };
    for (int round = 0; round < 60; ++round) {
      absl::StatusOr<uint32_t> pick =
          filter.SelectByNextUse(table, kGpu0, kNow, eligible, DistanceOf);
      ASSERT_TRUE(pick.ok()) << pick.status();
      ASSERT_EQ(*pick, Expected(filter, table, eligible))
          << HeuristicName(h) << " round " << round;
      taken.push_back(table.AtSlot(*pick).id);
    }
  }
}

// In a Batch the picks after the first come from a ranking by each
// tensor's distance: they are still what a scan of every candidate picks
// as releases raise the neighbours' recompute costs, eligibility changes
// both ways from pick to pick, and some picks are refused.
TEST(FilterNextUseTest, PicksOfABatchAreWhatAScanPicks) {
  for (Heuristic h : {Heuristic::kDelta, Heuristic::kLru, Heuristic::kDtr,
                      Heuristic::kDtrEq, Heuristic::kDeltaCost}) {
    TensorTable table;
    Fill(table, 400);
    Filter filter(Options(h));
    Filter::Batch batch(filter);
    for (int round = 0; round < 150; ++round) {
      auto eligible = [round](const Tensor& t) {
        return round % 3 == 0 || t.id % 2 == (round % 3 == 1 ? 1u : 0u);
      };
      absl::StatusOr<uint32_t> pick =
          filter.SelectByNextUse(table, kGpu0, kNow, eligible, DistanceOf);
      ASSERT_TRUE(pick.ok()) << pick.status();
      ASSERT_EQ(*pick, Expected(filter, table, eligible))
          << HeuristicName(h) << " round " << round;
      // Every fifth pick is refused by its caller: it must come up again.
      if (round % 5 != 4) {
        ASSERT_TRUE(
            table.SetState(table.AtSlot(*pick).id, TensorState::kEvicted).ok());
      }
    }
  }
}

// Greedy and MegEngine have no staleness to stand in for: they pick as
// Select does.
TEST(FilterNextUseTest, ScoresWithoutStalenessPickAsSelectDoes) {
  TensorTable table;
  Fill(table, 200);
  for (Heuristic h : {Heuristic::kGreedy, Heuristic::kMegEngine}) {
    Filter a(Options(h)), b(Options(h));
    auto any = [](const Tensor&) { return true; };
    absl::StatusOr<uint32_t> by_next =
        a.SelectByNextUse(table, kGpu0, kNow, any, DistanceOf);
    absl::StatusOr<uint32_t> plain = b.Select(table, kGpu0, kNow, any);
    ASSERT_TRUE(by_next.ok() && plain.ok());
    EXPECT_EQ(*by_next, *plain) << HeuristicName(h);
  }
}

TEST(FilterNextUseTest, LockedTensorsAreNotPickedAndNoneLeftIsNotFound) {
  TensorTable table;
  AddAt(table, Spec(1, 100), 0);
  AddAt(table, Spec(2, 100), 0);
  ASSERT_TRUE(table.Lock(2).ok());
  Filter filter(Options(Heuristic::kDelta));
  auto never = [](const Tensor&) -> int64_t { return -1; };
  auto any = [](const Tensor&) { return true; };
  absl::StatusOr<uint32_t> pick =
      filter.SelectByNextUse(table, kGpu0, kNow, any, never);
  ASSERT_TRUE(pick.ok()) << pick.status();
  EXPECT_EQ(table.AtSlot(*pick).id, 1u);
  ASSERT_TRUE(table.Lock(1).ok());
  EXPECT_TRUE(absl::IsNotFound(
      filter.SelectByNextUse(table, kGpu0, kNow, any, never).status()));
}

}  // namespace
}  // namespace deltad::policy
