// Tests of the Filter heuristics (DELTA eqs. 1-3, DTR's h_DTR and h_DTR-eq,
// MegEngine's evaluation function) and of the Filter's candidate search
// (DELTA Algorithm 2, with DTR's sampling and small-tensor skipping).

#include "policies/filter.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
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

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr Heuristic kAllHeuristics[] = {
    Heuristic::kDelta, Heuristic::kLru,   Heuristic::kGreedy,
    Heuristic::kDtr,   Heuristic::kDtrEq, Heuristic::kMegEngine,
};

TensorSpec Spec(TensorId id, int64_t bytes, int64_t compute_cost_ns = 0,
                std::vector<TensorId> parents = {}, SessionId session = 1,
                GpuId gpu = 0) {
  TensorSpec s;
  s.id = id;
  s.session = session;
  s.gpu = gpu;
  s.bytes = bytes;
  s.compute_cost_ns = compute_cost_ns;
  s.parents = std::move(parents);
  return s;
}

// Adds a tensor whose last access is `at_ns`.
void AddAt(TensorTable& table, const TensorSpec& spec, int64_t at_ns) {
  const absl::Status s = table.Add(spec, at_ns);
  ASSERT_TRUE(s.ok()) << s;
}

void Evict(TensorTable& table, TensorId id) {
  const absl::Status s = table.SetState(id, TensorState::kEvicted);
  ASSERT_TRUE(s.ok()) << s;
}

bool Any(const Tensor&) { return true; }

FilterOptions Options(Heuristic h, bool sampled = false,
                      bool skip_small = false, uint64_t seed = 1,
                      MegEngineParams me = {}) {
  FilterOptions o;
  o.heuristic = h;
  o.sampled = sampled;
  o.skip_small = skip_small;
  o.seed = seed;
  o.megengine = me;
  return o;
}

Scope GpuScope(GpuId gpu) { return Scope{gpu, std::nullopt}; }
Scope SessionScope(GpuId gpu, SessionId session) { return Scope{gpu, session}; }

TensorId SelectId(Filter& filter, const TensorTable& table, const Scope& scope,
                  int64_t now_ns) {
  absl::StatusOr<uint32_t> pick = filter.Select(table, scope, now_ns, Any);
  EXPECT_TRUE(pick.ok()) << pick.status();
  return pick.ok() ? table.AtSlot(*pick).id : 0;
}

// The order in which the Filter would release every candidate of `scope`,
// scores fixed at `now_ns` (each pick is excluded from the next search).
std::vector<TensorId> ReleaseOrder(const TensorTable& table, Heuristic h,
                                   const Scope& scope, int64_t now_ns,
                                   MegEngineParams me = {}) {
  Filter filter(Options(h, false, false, 1, me));
  std::vector<TensorId> order;
  while (true) {
    absl::StatusOr<uint32_t> pick =
        filter.Select(table, scope, now_ns, [&order](const Tensor& t) {
          return std::find(order.begin(), order.end(), t.id) == order.end();
        });
    if (!pick.ok()) {
      EXPECT_TRUE(absl::IsNotFound(pick.status())) << pick.status();
      break;
    }
    order.push_back(table.AtSlot(*pick).id);
  }
  return order;
}

double ScoreOf(Heuristic h, const TensorTable& table, TensorId id,
               int64_t now_ns, MegEngineParams me = {}) {
  return Score(h, me, table, table.SlotOf(id), now_ns);
}

const Scope kGpu0 = GpuScope(0);
const Scope kSession1 = SessionScope(0, 1);

// --- Heuristics -----------------------------------------------------------

// Four tensors on which delta, lru and greedy all disagree. At now = 1000:
//   id  bytes  staleness  m*s
//   1    100     1000     1.0e5
//   2   2000      100     2.0e5
//   3    300      500     1.5e5
//   4   1500       10     1.5e4
class HeuristicOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AddAt(table_, Spec(1, 100), 0);
    AddAt(table_, Spec(2, 2000), 900);
    AddAt(table_, Spec(3, 300), 500);
    AddAt(table_, Spec(4, 1500), 990);
  }
  static constexpr int64_t kNow = 1000;
  TensorTable table_;
};

TEST_F(HeuristicOrderTest, DeltaReleasesLargestSizeTimesStalenessFirst) {
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kDelta, kGpu0, kNow),
              ElementsAre(2, 3, 1, 4));
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kDelta, table_, 3, kNow),
                   1.0 / (300.0 * 500.0));
}

TEST_F(HeuristicOrderTest, LruReleasesStalestFirst) {
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kLru, kGpu0, kNow),
              ElementsAre(1, 3, 2, 4));
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kLru, table_, 3, kNow), 1.0 / 500.0);
}

TEST_F(HeuristicOrderTest, GreedyReleasesLargestFirst) {
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kGreedy, kGpu0, kNow),
              ElementsAre(2, 4, 3, 1));
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kGreedy, table_, 3, kNow), 1.0 / 300.0);
}

TEST_F(HeuristicOrderTest, TouchMakesATensorFreshAgain) {
  ASSERT_TRUE(table_.Touch(1, kNow).ok());
  // Tensor 1 was the stalest; now it is the freshest.
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kLru, kGpu0, kNow),
              ElementsAre(3, 2, 4, 1));
}

TEST(HeuristicTest, StalenessOfATensorTouchedThisInstantIsOneNanosecond) {
  TensorTable table;
  AddAt(table, Spec(1, 64), 500);
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kLru, table, 1, 500), 1.0);
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kDelta, table, 1, 500), 1.0 / 64.0);
  // A clock that went backwards must not produce a negative staleness.
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kLru, table, 1, 100), 1.0);
}

// G -> P -> T -> C, and P -> S. G, P, S and C are evicted; T is resident.
// Exact neighbourhood of T: its evicted ancestors (P, G) and its evicted
// descendants (C), but not its evicted sibling S. The union-find
// neighbourhood adds the whole component {G, P, S} and the component {C}.
class HeuristicNeighbourhoodTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AddAt(table_, Spec(kG, 10, 1), 0);
    AddAt(table_, Spec(kP, 10, 100, {kG}), 0);
    AddAt(table_, Spec(kT, 50, 10, {kP}), 0);
    AddAt(table_, Spec(kS, 10, 10000, {kP}), 0);
    AddAt(table_, Spec(kC, 10, 1000, {kT}), 0);
    for (TensorId id : {kG, kP, kS, kC}) Evict(table_, id);
  }
  static constexpr TensorId kG = 1, kP = 2, kT = 3, kS = 4, kC = 5;
  static constexpr int64_t kNow = 200;  // staleness 200
  TensorTable table_;
};

TEST_F(HeuristicNeighbourhoodTest,
       DtrCountsEvictedAncestorsAndDescendantsOnly) {
  const double cost = 10 + 100 + 1 + 1000;  // T, P, G, C; not S
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kDtr, table_, kT, kNow),
                   cost / (50.0 * 200.0));
}

TEST_F(HeuristicNeighbourhoodTest, DtrEqCountsEveryAdjacentComponentWhole) {
  const double cost = 10 + (1 + 100 + 10000) + 1000;  // T, {G,P,S}, {C}
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kDtrEq, table_, kT, kNow),
                   cost / (50.0 * 200.0));
}

TEST_F(HeuristicNeighbourhoodTest, DtrStopsAtResidentTensors) {
  // Recomputing P makes it resident: G and S are no longer reachable from
  // T through evicted tensors, and P itself is not a cost any more.
  ASSERT_TRUE(table_.MarkRecomputed(kP, 0).ok());
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kDtr, table_, kT, kNow),
                   (10.0 + 1000.0) / (50.0 * 200.0));
  EXPECT_DOUBLE_EQ(ScoreOf(Heuristic::kDtrEq, table_, kT, kNow),
                   (10.0 + 1000.0) / (50.0 * 200.0));
}

// X and Y are resident with the same staleness; Y is slightly larger, so
// delta releases Y first. X's evicted parent is cheap but shares a component
// with an expensive evicted sibling; Y's evicted parent is moderately
// expensive. dtr (exact) sees X as cheap; dtr_eq charges X the sibling.
TEST(HeuristicTest, DtrAndDtrEqDisagreeWhenAnEvictedSiblingSharesAComponent) {
  TensorTable table;
  AddAt(table, Spec(1, 10, 100), 0);         // X's parent
  AddAt(table, Spec(2, 100, 10, {1}), 0);    // X
  AddAt(table, Spec(3, 10, 10000, {1}), 0);  // X's sibling
  AddAt(table, Spec(4, 10, 1000), 0);        // Y's parent
  AddAt(table, Spec(5, 110, 10, {4}), 0);    // Y
  for (TensorId id : {1, 3, 4}) Evict(table, id);
  constexpr int64_t kNow = 100;

  EXPECT_THAT(ReleaseOrder(table, Heuristic::kDelta, kGpu0, kNow),
              ElementsAre(5, 2));
  // X: (10 + 100) / 100 = 1.1 per unit; Y: (10 + 1000) / 110 = 9.2.
  EXPECT_THAT(ReleaseOrder(table, Heuristic::kDtr, kGpu0, kNow),
              ElementsAre(2, 5));
  // X: (10 + 100 + 10000) / 100 = 101; Y: 9.2.
  EXPECT_THAT(ReleaseOrder(table, Heuristic::kDtrEq, kGpu0, kNow),
              ElementsAre(5, 2));
}

// A and B: same compute cost and staleness; A is larger, so dtr_eq (and
// MegEngine with neutral terms) releases A first.
class HeuristicMegEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AddAt(table_, Spec(kA, 1000, 100), 0);
    AddAt(table_, Spec(kB, 900, 100), 0);
  }
  static constexpr TensorId kA = 1, kB = 2;
  static constexpr int64_t kNow = 1000;
  TensorTable table_;
};

TEST_F(HeuristicMegEngineTest, WithoutFragmentationOrRecomputesItMatchesDtrEq) {
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kDtrEq, kGpu0, kNow),
              ElementsAre(kA, kB));
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kMegEngine, kGpu0, kNow),
              ElementsAre(kA, kB));
  EXPECT_NEAR(ScoreOf(Heuristic::kMegEngine, table_, kA, kNow),
              100.001 / (1000.0 * 1000.0), 1e-15);
}

TEST_F(HeuristicMegEngineTest, AdjacentFreeBytesMoveATensorAhead) {
  ASSERT_TRUE(table_.SetAdjacentFreeBytes(kB, 500).ok());
  // B joins 500 free bytes: its effective size 1400 beats A's 1000.
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kMegEngine, kGpu0, kNow),
              ElementsAre(kB, kA));
  EXPECT_NEAR(ScoreOf(Heuristic::kMegEngine, table_, kB, kNow),
              100.001 / (1400.0 * 1000.0), 1e-15);
  // The other heuristics ignore fragmentation.
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kDtrEq, kGpu0, kNow),
              ElementsAre(kA, kB));
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kDelta, kGpu0, kNow),
              ElementsAre(kA, kB));
}

TEST_F(HeuristicMegEngineTest, RecomputeCountPenaltySparesRecomputedTensors) {
  for (int i = 0; i < 2; ++i) {
    Evict(table_, kA);
    ASSERT_TRUE(table_.MarkRecomputed(kA, 0).ok());
  }
  ASSERT_EQ(table_.Find(kA)->recompute_count, 2u);
  // A's score is multiplied by 1.5^2 = 2.25: B (1000/900 = 1.11x) goes first.
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kMegEngine, kGpu0, kNow),
              ElementsAre(kB, kA));
  EXPECT_NEAR(ScoreOf(Heuristic::kMegEngine, table_, kA, kNow),
              2.25 * 100.001 / (1000.0 * 1000.0), 1e-15);
  // dtr_eq has no such term.
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kDtrEq, kGpu0, kNow),
              ElementsAre(kA, kB));
  // A penalty of 1 turns the term off.
  EXPECT_THAT(ReleaseOrder(table_, Heuristic::kMegEngine, kGpu0, kNow,
                           MegEngineParams{.recompute_penalty = 1.0}),
              ElementsAre(kA, kB));
}

TEST(HeuristicTest, MegEngineExponentsWeighTheTerms) {
  // Same size and cost; tensor 1 is twice as stale, tensor 2 sits next to
  // 1500 free bytes (effective size 2500).
  TensorTable table;
  AddAt(table, Spec(1, 1000, 100), 0);    // s = 1000
  AddAt(table, Spec(2, 1000, 100), 500);  // s = 500
  ASSERT_TRUE(table.SetAdjacentFreeBytes(2, 1500).ok());
  // Default exponents: 1 scores c/(1000*1000), 2 scores c/(2500*500).
  EXPECT_THAT(ReleaseOrder(table, Heuristic::kMegEngine, kGpu0, 1000),
              ElementsAre(2, 1));
  // Ignoring memory (mem_exp 0) leaves only staleness: 1 first.
  EXPECT_THAT(ReleaseOrder(table, Heuristic::kMegEngine, kGpu0, 1000,
                           MegEngineParams{.mem_exp = 0.0}),
              ElementsAre(1, 2));
}

TEST(ParseHeuristicTest, AcceptsEveryName) {
  const std::pair<const char*, Heuristic> cases[] = {
      {"delta", Heuristic::kDelta},
      {"lru", Heuristic::kLru},
      {"greedy", Heuristic::kGreedy},
      {"dtr", Heuristic::kDtr},
      {"dtr_eq", Heuristic::kDtrEq},
      {"megengine", Heuristic::kMegEngine},
      {"delta_cost", Heuristic::kDeltaCost},
  };
  for (const auto& [name, h] : cases) {
    absl::StatusOr<Heuristic> parsed = ParseHeuristic(name);
    ASSERT_TRUE(parsed.ok()) << name << ": " << parsed.status();
    EXPECT_EQ(*parsed, h) << name;
    EXPECT_EQ(HeuristicName(h), name);
  }
}

TEST(ParseHeuristicTest, RejectsOtherNamesListingTheValidOnes) {
  for (const char* bad : {"", "Delta", "DTR", "dtr-eq", "lru ", "random"}) {
    absl::StatusOr<Heuristic> parsed = ParseHeuristic(bad);
    ASSERT_FALSE(parsed.ok()) << "'" << bad << "' was accepted";
    EXPECT_TRUE(absl::IsInvalidArgument(parsed.status())) << parsed.status();
    const std::string msg(parsed.status().message());
    EXPECT_THAT(msg, HasSubstr(std::string("'") + bad + "'"));
    for (const char* name : {"delta", "lru", "greedy", "dtr", "dtr_eq",
                             "megengine", "delta_cost"}) {
      EXPECT_THAT(msg, HasSubstr(name));
    }
  }
}

// --- Filter search ----------------------------------------------------------

// A deterministic mix of sizes, access times, costs and evicted parents.
void FillMixed(TensorTable& table, int n) {
  uint64_t x = 12345;
  auto next = [&x] {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return x >> 33;
  };
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

TEST(HeuristicTest, DeltaCostPricesTheCheaperOfRecomputeAndSwap) {
  // 1 GB/s both ways: swapping b bytes costs 2b ns.
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {1e9, 1e9}).ok());
  TensorTable table;
  ASSERT_TRUE(table.Add(Spec(1, 1000, /*compute_cost_ns=*/500), 0).ok());
  ASSERT_TRUE(table.Add(Spec(2, 1000, /*compute_cost_ns=*/5000), 0).ok());
  const MegEngineParams me;
  const int64_t now = 10;  // staleness 10 ns for both
  const auto score = [&](TensorId id) {
    return Score(Heuristic::kDeltaCost, me, table, table.SlotOf(id), now,
                 &costs);
  };
  // min(500, 2000) and min(5000, 2000), over m * s = 10000.
  EXPECT_DOUBLE_EQ(score(1), 500.0 / 10000);
  EXPECT_DOUBLE_EQ(score(2), 2000.0 / 10000);
  // A queue on the link makes swapping dearer: the recompute price stays.
  costs.SetOffloadBacklog(0, 3000);
  EXPECT_DOUBLE_EQ(score(1), 500.0 / 10000);
  EXPECT_DOUBLE_EQ(score(2), 5000.0 / 10000);
}

TEST(HeuristicTest, DeltaCostTreatsAForbiddenActionAsInfinitelyDear) {
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {1e9, 1e9}).ok());
  TensorTable table;
  TensorSpec pinned = Spec(1, 1000, /*compute_cost_ns=*/10);
  pinned.flags.evict_pinned = true;  // only the 2000 ns swap is allowed
  ASSERT_TRUE(table.Add(pinned, 0).ok());
  const double s = Score(Heuristic::kDeltaCost, MegEngineParams{}, table,
                         table.SlotOf(1), 10, &costs);
  EXPECT_DOUBLE_EQ(s, 2000.0 / 10000);
}

TEST(HeuristicTest, DeltaCostCountsEvictedChildrenInTheRecomputePrice) {
  // Swapping is dear (1 byte/ns for 100000 bytes); recompute decides.
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {1e9, 1e9}).ok());
  TensorTable table;
  ASSERT_TRUE(table.Add(Spec(1, 100000, /*compute_cost_ns=*/100), 0).ok());
  TensorSpec child = Spec(2, 100000, /*compute_cost_ns=*/700);
  child.parents = {1};
  ASSERT_TRUE(table.Add(child, 0).ok());
  const auto score = [&] {
    return Score(Heuristic::kDeltaCost, MegEngineParams{}, table,
                 table.SlotOf(1), 10, &costs);
  };
  EXPECT_DOUBLE_EQ(score(), 100.0 / (100000.0 * 10));
  // With its child evicted, evicting 1 would make the child's rebuild
  // need 1 as well: the price is both.
  ASSERT_TRUE(table.SetState(2, TensorState::kEvicted).ok());
  EXPECT_DOUBLE_EQ(score(), 800.0 / (100000.0 * 10));
}

}  // namespace
}  // namespace deltad::policy
