// Tests of the Filter's candidate search (DELTA Algorithm 2, with DTR's
// sampling and small-tensor skipping).

#include "policies/filter.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/heuristic.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/filter_test_helpers.h"
#include "tests/unit/policies/tensor_table_test_helpers.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::GpuScope;
using testing_util::SessionScope;

constexpr Heuristic kAllHeuristics[] = {
    Heuristic::kDelta, Heuristic::kLru,   Heuristic::kGreedy,
    Heuristic::kDtr,   Heuristic::kDtrEq, Heuristic::kMegEngine,
};

// Those whose bound the search uses (every one but MegEngine's).
constexpr Heuristic kBoundedHeuristics[] = {
    Heuristic::kDelta, Heuristic::kLru,   Heuristic::kGreedy,
    Heuristic::kDtr,   Heuristic::kDtrEq, Heuristic::kDeltaCost,
};

bool Any(const Tensor&) { return true; }

TensorId SelectId(Filter& filter, const TensorTable& table, const Scope& scope,
                  int64_t now_ns) {
  absl::StatusOr<uint32_t> pick = filter.Select(table, scope, now_ns, Any);
  EXPECT_TRUE(pick.ok()) << pick.status();
  return pick.ok() ? table.AtSlot(*pick).id : 0;
}

const Scope kSession1 = SessionScope(0, 1);

// A deterministic mix of sizes, access times, costs and evicted parents.
void FillMixed(TensorTable& table, int n) {
  TestLcg next(12345);
  for (int i = 1; i <= n; ++i) {
    std::vector<TensorId> parents;
    if (i > 3 && next() % 2 == 0) {
      parents.push_back(static_cast<TensorId>(1 + next() % (i - 1)));
    }
    AddAt(
        table,
        Spec(static_cast<TensorId>(i), 1 + static_cast<int64_t>(next() % 5000),
             static_cast<int64_t>(next() % 10000), parents),
        static_cast<int64_t>(next() % 100000));
  }
  for (int i = 1; i <= n; i += 7) Evict(table, static_cast<TensorId>(i));
}

TEST(FilterTest, ExactSearchReturnsTheMinimumScore) {
  TensorTable table;
  FillMixed(table, 200);
  constexpr int64_t kNow = 200000;
  for (Heuristic h : kAllHeuristics) {
    Filter filter(Options(h));
    absl::StatusOr<uint32_t> pick = filter.Select(table, kGpu0, kNow, Any);
    ASSERT_TRUE(pick.ok()) << pick.status();
    EXPECT_EQ(table.AtSlot(*pick).state, TensorState::kResident);
    double min_score = INFINITY;
    for (uint32_t slot : table.Candidates(kGpu0)) {
      min_score = std::min(min_score, filter.Score(table, slot, kNow));
    }
    EXPECT_EQ(filter.Score(table, *pick, kNow), min_score) << HeuristicName(h);
  }
}

// Scores that tie often (two sizes and access times, three costs: 0, 500
// and 1000 ns), each tensor with one earlier parent, every
// `evict_every`-th evicted.
void FillTying(TensorTable& table, int n, uint64_t seed, int evict_every) {
  TestLcg next(seed);
  for (TensorId id = 1; id <= static_cast<TensorId>(n); ++id) {
    std::vector<TensorId> parents;
    if (id > 1) parents.push_back(1 + next() % (id - 1));
    AddAt(table,
          Spec(id, 1000 * (1 + static_cast<int64_t>(next() % 2)),
               500 * static_cast<int64_t>(next() % 3), parents),
          10 * static_cast<int64_t>(next() % 2));
  }
  for (TensorId id = 1; id <= static_cast<TensorId>(n); id += evict_every) {
    Evict(table, id);
  }
}

// Scores that tie often and evicted
// neighbours that make the walk add to a tensor's own cost: a search that
// skips candidates by their lower bound must still pick the first of the
// lowest scores in candidate order, as scoring every one does.
TEST(FilterTest, SearchesSkippingByLowerBoundPickWhatScoringAllPicks) {
  TensorTable table;
  FillTying(table, 400, /*seed=*/7, /*evict_every=*/5);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9}).ok());  // a swap: 500 ns
  constexpr int64_t kNow = 20;
  for (Heuristic h : kBoundedHeuristics) {
    Filter filter(Options(h), &costs);
    // Excluding each pick in turn walks the order down through the ties.
    std::vector<uint32_t> taken;
    auto eligible = [&taken](const Tensor& t) {
      return std::find(taken.begin(), taken.end(), t.id) == taken.end();
    };
    for (int round = 0; round < 40; ++round) {
      absl::StatusOr<uint32_t> pick =
          filter.Select(table, kGpu0, kNow, eligible);
      ASSERT_TRUE(pick.ok()) << pick.status();
      const uint32_t want = FirstLowestScore(filter, table, kNow, eligible);
      ASSERT_EQ(*pick, want) << HeuristicName(h) << " round " << round;
      taken.push_back(static_cast<uint32_t>(table.AtSlot(*pick).id));
    }
  }
}

// delta_cost's exact search passes over entries whose bound is certainly
// above the best by a check without division: its picks are still the
// first of the lowest scores, with swaps priced behind a backlog, host
// copies that leave the reload alone, pinned tensors (one term only), and
// recompute and swap costs that tie (1000 bytes each way at 4 GB/s: 250
// ns each; costs of 0 to 1500 ns).
TEST(FilterTest, ExactDeltaCostSearchPicksTheLowestScoreWhateverPricesTheSwap) {
  TensorTable table;
  TestLcg next(21);
  for (TensorId id = 1; id <= 600; ++id) {
    std::vector<TensorId> parents;
    if (id > 1 && next() % 2 == 0) parents.push_back(1 + next() % (id - 1));
    TensorSpec spec = Spec(id, 1000 * (1 + static_cast<int64_t>(next() % 2)),
                           250 * static_cast<int64_t>(next() % 7), parents);
    switch (next() % 6) {
      case 0:
        spec.flags.offload_pinned = true;
        break;
      case 1:
        spec.flags.evict_pinned = true;
        break;
      case 2:
        spec.flags.uncomputable = true;
        break;
      default:
        break;
    }
    AddAt(table, spec, 10 * static_cast<int64_t>(next() % 3));
    if (next() % 3 == 0) {
      ASSERT_TRUE(table.SetHostCopy(id, true).ok());
    }
  }
  for (TensorId id = 1; id <= 600; id += 5) {
    const Tensor* t = table.Find(id);
    if (!t->flags.evict_pinned && !t->flags.uncomputable) Evict(table, id);
  }
  for (int64_t backlog : {0, 1000, 3000})
    for (int64_t latency : {0, 400, 4000}) {
      CostModel costs;
      ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9, latency}).ok());
      costs.SetOffloadBacklog(0, backlog);
      Filter filter(Options(Heuristic::kDeltaCost), &costs);
      std::vector<TensorId> taken;
      auto eligible = [&taken](const Tensor& t) {
        return std::find(taken.begin(), taken.end(), t.id) == taken.end();
      };
      for (int round = 0; round < 60; ++round) {
        constexpr int64_t kNow = 40;
        absl::StatusOr<uint32_t> pick =
            filter.Select(table, kGpu0, kNow, eligible);
        ASSERT_TRUE(pick.ok()) << pick.status();
        const uint32_t want = FirstLowestScore(filter, table, kNow, eligible);
        ASSERT_EQ(*pick, want) << "backlog " << backlog << " latency "
                               << latency << " round " << round;
        taken.push_back(table.AtSlot(*pick).id);
      }
    }
}

// The same with sampling: for a seed, the search that skips by the bound
// (scoring the lowest bound first) picks what scoring every sample picks,
// ties included (tensors whose own cost is 0 but whose evicted neighbours
// cost as much as others' own).
TEST(FilterTest, SampledSearchesSkippingByLowerBoundPickWhatScoringAllPicks) {
  TensorTable table;
  FillTying(table, 900, /*seed=*/11, /*evict_every=*/4);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9}).ok());
  // Half the tensors ineligible: the lowest bound of a sample is then
  // often one that cannot be taken.
  auto odd = [](const Tensor& t) { return t.id % 2 == 1; };
  for (Heuristic h : kBoundedHeuristics) {
    for (uint64_t seed = 1; seed <= 50; ++seed) {
      FilterOptions skipping = Options(h, /*sampled=*/true, false, seed);
      FilterOptions scoring = skipping;
      scoring.skip_by_bound = false;
      Filter a(skipping, &costs), b(scoring, &costs);
      for (int call = 0; call < 6; ++call) {
        const Filter::Eligible eligible =
            call % 2 == 0 ? Filter::Eligible(Any) : Filter::Eligible(odd);
        absl::StatusOr<uint32_t> pa = a.Select(table, kGpu0, 20, eligible);
        absl::StatusOr<uint32_t> pb = b.Select(table, kGpu0, 20, eligible);
        ASSERT_TRUE(pa.ok() && pb.ok());
        ASSERT_EQ(*pa, *pb) << HeuristicName(h) << " seed " << seed;
      }
    }
  }
}

// In a Batch a large sample serves several picks, re-bounded from the
// tensors as earlier picks left them (released: no longer candidates).
TEST(FilterTest,
     BatchedSampledSearchesSkippingByLowerBoundPickWhatScoringAllPicks) {
  // ceil(sqrt(20000)) = 142 samples: two picks from each sample.
  constexpr int kTensors = 20000;
  TensorTable skipped, scored;
  FillTying(skipped, kTensors, /*seed=*/5, /*evict_every=*/9);
  FillTying(scored, kTensors, /*seed=*/5, /*evict_every=*/9);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9}).ok());
  for (Heuristic h : kBoundedHeuristics) {
    FilterOptions skipping = Options(h, /*sampled=*/true, false, /*seed=*/3);
    FilterOptions scoring = skipping;
    scoring.skip_by_bound = false;
    Filter a(skipping, &costs), b(scoring, &costs);
    Filter::Batch batch_a(a), batch_b(b);
    for (int pick = 0; pick < 6; ++pick) {
      absl::StatusOr<uint32_t> pa = a.Select(skipped, kGpu0, 20, Any);
      absl::StatusOr<uint32_t> pb = b.Select(scored, kGpu0, 20, Any);
      ASSERT_TRUE(pa.ok() && pb.ok());
      ASSERT_EQ(*pa, *pb) << HeuristicName(h) << " pick " << pick;
      const TensorId id = skipped.AtSlot(*pa).id;
      ASSERT_TRUE(skipped.SetState(id, TensorState::kOffloading).ok());
      ASSERT_TRUE(scored.SetState(id, TensorState::kOffloading).ok());
    }
  }
}

TEST(FilterTest, ExactSearchHonoursEligibility) {
  TensorTable table;
  FillMixed(table, 100);
  Filter filter;
  absl::StatusOr<uint32_t> pick = filter.Select(
      table, kGpu0, 200000, [](const Tensor& t) { return t.bytes < 1000; });
  ASSERT_TRUE(pick.ok()) << pick.status();
  EXPECT_LT(table.AtSlot(*pick).bytes, 1000);
  double min_score = INFINITY;
  for (uint32_t slot : table.Candidates(kGpu0)) {
    if (table.AtSlot(slot).bytes < 1000) {
      min_score = std::min(min_score, filter.Score(table, slot, 200000));
    }
  }
  EXPECT_EQ(filter.Score(table, *pick, 200000), min_score);
}

TEST(FilterTest, OnlyResidentTensorsAreCandidates) {
  TensorTable table;
  AddAt(table, Spec(1, 100), 0);  // stalest
  AddAt(table, Spec(2, 100), 1);
  AddAt(table, Spec(3, 100), 2);
  AddAt(table, Spec(4, 100), 3);
  Filter filter(Options(Heuristic::kLru));
  EXPECT_EQ(SelectId(filter, table, kGpu0, 10), 1u);
  Evict(table, 1);
  EXPECT_EQ(SelectId(filter, table, kGpu0, 10), 2u);
  ASSERT_TRUE(table.SetState(2, TensorState::kOffloading).ok());
  EXPECT_EQ(SelectId(filter, table, kGpu0, 10), 3u);
  ASSERT_TRUE(table.Free(3).ok());
  EXPECT_EQ(SelectId(filter, table, kGpu0, 10), 4u);
}

// 400 tensors, stalest first by id; LRU scores are all distinct.
void FillStaleness(TensorTable& table, int n) {
  for (int i = 1; i <= n; ++i) {
    AddAt(table, Spec(static_cast<TensorId>(i), 100), i);
  }
}

std::vector<TensorId> SampledPicks(const TensorTable& table, uint64_t seed,
                                   int calls, Filter::Eligible eligible = Any) {
  Filter filter(Options(Heuristic::kLru, /*sampled=*/true, false, seed));
  std::vector<TensorId> picks;
  for (int i = 0; i < calls; ++i) {
    absl::StatusOr<uint32_t> pick = filter.Select(table, kGpu0, 1000, eligible);
    EXPECT_TRUE(pick.ok()) << pick.status();
    if (pick.ok()) picks.push_back(table.AtSlot(*pick).id);
  }
  return picks;
}

TEST(FilterTest, SampledSearchIsDeterministicForASeed) {
  TensorTable table;
  FillStaleness(table, 400);
  const std::vector<TensorId> first = SampledPicks(table, 42, 30);
  const std::vector<TensorId> again = SampledPicks(table, 42, 30);
  EXPECT_EQ(first, again);
  // The sequence advances from call to call: not the same pick every time.
  EXPECT_GT(std::set<TensorId>(first.begin(), first.end()).size(), 1u);
  // And it depends on the seed.
  EXPECT_NE(first, SampledPicks(table, 43, 30));
}

TEST(FilterTest, SampledSearchScoresASampleNotEveryTensor) {
  TensorTable table;
  FillStaleness(table, 400);  // exact search would always pick tensor 1
  const std::vector<TensorId> picks = SampledPicks(table, 7, 30);
  EXPECT_GT(std::count_if(picks.begin(), picks.end(),
                          [](TensorId id) { return id != 1; }),
            0);
  // The best of ceil(sqrt(400)) = 20 random candidates is rarely far down:
  // each pick must be beaten by few tensors (loose bound, deterministic).
  for (TensorId id : picks) EXPECT_LE(id, 200u);
}

// Below exact_below a sampled filter (skipping small tensors) searches as
// the plain one: every candidate, the small one too. At or above it, it
// samples again.
TEST(FilterTest, SampledSearchOfFewerCandidatesThanExactBelowScoresEveryOne) {
  TensorTable table;
  // Exact search, small ones aside, always picks tensor 1.
  for (TensorId id = 1; id <= 400; ++id) {
    AddAt(table, Spec(id, 1000), static_cast<int64_t>(id));
  }
  constexpr TensorId kSmall = 999;  // the stalest, under 1% of the mean
  AddAt(table, Spec(kSmall, 1), 0);
  FilterOptions o = Options(Heuristic::kLru, /*sampled=*/true,
                            /*skip_small=*/true, /*seed=*/7);
  o.exact_below = 402;
  Filter exact(o);
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(SelectId(exact, table, kGpu0, 1000), kSmall);
  }
  o.exact_below = 401;
  Filter sampling(o);
  int others = 0;
  for (int i = 0; i < 30; ++i) {
    const TensorId id = SelectId(sampling, table, kGpu0, 1000);
    EXPECT_NE(id, kSmall);
    others += id != 1;
  }
  EXPECT_GT(others, 0);
}

TEST(FilterTest, SampledSearchPicksOnlyEligibleUnlockedTensors) {
  TensorTable table;
  FillStaleness(table, 400);
  for (TensorId id = 2; id <= 400; id += 4) ASSERT_TRUE(table.Lock(id).ok());
  const std::vector<TensorId> picks =
      SampledPicks(table, 3, 50, [](const Tensor& t) { return t.id % 2 == 0; });
  ASSERT_EQ(picks.size(), 50u);
  for (TensorId id : picks) {
    EXPECT_EQ(id % 2, 0u) << id;
    EXPECT_NE(id % 4, 2u) << id << " is locked";
  }
}

TEST(FilterTest, SampledSearchFallsBackToExactWhenNoSampleQualifies) {
  TensorTable table;
  FillStaleness(table, 400);
  // One eligible tensor in 400: a sample of 20 usually misses it.
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const std::vector<TensorId> picks = SampledPicks(
        table, seed, 5, [](const Tensor& t) { return t.id == 333; });
    EXPECT_THAT(picks, ElementsAre(333, 333, 333, 333, 333)) << seed;
  }
}

TEST(FilterTest, SampledSearchIsNotFoundOnlyWhenNothingQualifies) {
  TensorTable table;
  FillStaleness(table, 100);
  Filter filter(Options(Heuristic::kDelta, /*sampled=*/true));
  absl::StatusOr<uint32_t> none =
      filter.Select(table, kGpu0, 1000, [](const Tensor&) { return false; });
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("GPU 0"));

  TensorTable empty;
  absl::StatusOr<uint32_t> nothing = filter.Select(empty, kGpu0, 1000, Any);
  EXPECT_TRUE(absl::IsNotFound(nothing.status())) << nothing.status();
}

// Ten tensors of 1000 bytes and one of 1 byte, the stalest. The mean is
// ~909 bytes, so 1% is 9: the 1-byte tensor is small.
class FilterSkipSmallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AddAt(table_, Spec(kSmall, 1), 0);
    for (TensorId id = 1; id <= 10; ++id) AddAt(table_, Spec(id, 1000), id);
  }
  static constexpr TensorId kSmall = 99;
  TensorTable table_;
};

TEST_F(FilterSkipSmallTest, IgnoresTensorsUnderOnePercentOfTheMean) {
  Filter plain(Options(Heuristic::kLru));
  EXPECT_EQ(SelectId(plain, table_, kGpu0, 100), kSmall);
  Filter skipping(Options(Heuristic::kLru, false, /*skip_small=*/true));
  EXPECT_EQ(SelectId(skipping, table_, kGpu0, 100), 1u);
  Filter sampled(
      Options(Heuristic::kLru, /*sampled=*/true, /*skip_small=*/true));
  for (int i = 0; i < 20; ++i) {
    EXPECT_NE(SelectId(sampled, table_, kGpu0, 100), kSmall);
  }
}

TEST(FilterTest, SkipSmallKeepsTensorsAtOnePercentOfTheMean) {
  constexpr TensorId kSmall = 99;
  // 10 x 1000 + 10 = 10010 bytes over 11 tensors: mean 910, 1% is 9.
  TensorTable table;
  AddAt(table, Spec(kSmall, 10), 0);
  for (TensorId id = 1; id <= 10; ++id) AddAt(table, Spec(id, 1000), id);
  Filter skipping(Options(Heuristic::kLru, false, /*skip_small=*/true));
  EXPECT_EQ(SelectId(skipping, table, kGpu0, 100), kSmall);
}

TEST_F(FilterSkipSmallTest, StillReturnsASmallTensorWhenOnlySmallOnesQualify) {
  for (bool sampled : {false, true}) {
    Filter skipping(Options(Heuristic::kLru, sampled, /*skip_small=*/true));
    absl::StatusOr<uint32_t> pick = skipping.Select(
        table_, kGpu0, 100, [](const Tensor& t) { return t.id == kSmall; });
    ASSERT_TRUE(pick.ok()) << pick.status();
    EXPECT_EQ(table_.AtSlot(*pick).id, kSmall);
    absl::StatusOr<uint32_t> none = skipping.Select(
        table_, kGpu0, 100, [](const Tensor&) { return false; });
    EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  }
}

TEST(FilterTest, LockedTensorsAreNeverSelected) {
  TensorTable table;
  FillStaleness(table, 50);
  ASSERT_TRUE(table.Lock(1).ok());
  ASSERT_TRUE(table.Lock(1).ok());  // twice: needs two unlocks
  ASSERT_TRUE(table.Lock(2).ok());
  Filter exact(Options(Heuristic::kLru));
  EXPECT_EQ(SelectId(exact, table, kGpu0, 1000), 3u);

  ASSERT_TRUE(table.Unlock(1).ok());
  EXPECT_EQ(SelectId(exact, table, kGpu0, 1000), 3u);
  ASSERT_TRUE(table.Unlock(1).ok());
  EXPECT_EQ(SelectId(exact, table, kGpu0, 1000), 1u);

  // All locked but one: exact and sampled search both find that one.
  for (TensorId id = 1; id <= 50; ++id) {
    if (id != 2 && id != 37) {
      ASSERT_TRUE(table.Lock(id).ok());
    }
  }
  // 2 is still locked from above; 37 is the only unlocked tensor.
  EXPECT_EQ(SelectId(exact, table, kGpu0, 1000), 37u);
  Filter sampled(Options(Heuristic::kLru, /*sampled=*/true));
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(SelectId(sampled, table, kGpu0, 1000), 37u);
  }
  ASSERT_TRUE(table.Lock(37).ok());
  EXPECT_TRUE(absl::IsNotFound(exact.Select(table, kGpu0, 1000, Any).status()));
  EXPECT_TRUE(
      absl::IsNotFound(sampled.Select(table, kGpu0, 1000, Any).status()));
}

// GPU 0 holds sessions 1 and 2; GPU 1 holds session 3. Staleness by id.
class FilterScopeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AddAt(table_, Spec(1, 100, 0, {}, /*session=*/3, /*gpu=*/1), 0);
    AddAt(table_, Spec(2, 100, 0, {}, /*session=*/2, /*gpu=*/0), 10);
    AddAt(table_, Spec(3, 100, 0, {}, /*session=*/1, /*gpu=*/0), 20);
    AddAt(table_, Spec(4, 100, 0, {}, /*session=*/2, /*gpu=*/0), 30);
    AddAt(table_, Spec(5, 100, 0, {}, /*session=*/1, /*gpu=*/0), 40);
  }
  TensorTable table_;
  Filter filter_{Options(Heuristic::kLru)};
};

TEST_F(FilterScopeTest, GpuScopeSelectsAcrossSessionsOfThatGpuOnly) {
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kLru, kGpu0, 100),
              ElementsAre(2, 3, 4, 5));
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kLru, GpuScope(1), 100),
              ElementsAre(1));
}

TEST_F(FilterScopeTest, SessionScopeSelectsOnlyThatSessionsTensors) {
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kLru, kSession1, 100),
              ElementsAre(3, 5));
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kLru, SessionScope(0, 2), 100),
              ElementsAre(2, 4));
}

TEST_F(FilterScopeTest, UnknownScopeIsNotFoundAndSaysWhich) {
  absl::StatusOr<uint32_t> pick =
      filter_.Select(table_, SessionScope(0, 9), 100, Any);
  ASSERT_TRUE(absl::IsNotFound(pick.status())) << pick.status();
  EXPECT_THAT(std::string(pick.status().message()), HasSubstr("session 9"));
  pick = filter_.Select(table_, GpuScope(5), 100, Any);
  ASSERT_TRUE(absl::IsNotFound(pick.status())) << pick.status();
  EXPECT_THAT(std::string(pick.status().message()), HasSubstr("GPU 5"));
}

}  // namespace
}  // namespace deltad::policy
