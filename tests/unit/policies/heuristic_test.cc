// Tests of the Filter heuristics (DELTA eqs. 1-3, DTR's h_DTR and h_DTR-eq,
// MegEngine's evaluation function, delta_cost) and of their names.

#include "policies/heuristic.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/filter_test_helpers.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

double ScoreOf(Heuristic h, const TensorTable& table, TensorId id,
               int64_t now_ns, MegEngineParams me = {}) {
  return Score(h, me, table, table.SlotOf(id), now_ns);
}

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

// A table where evicted parents and children make the neighbourhood cost
// exceed the tensor's own, and the flags forbid one action or the other.
void FillWithEvictedNeighbours(TensorTable& table) {
  TestLcg next(99);
  for (TensorId id = 1; id <= 300; ++id) {
    TensorSpec s = Spec(id, 1 + static_cast<int64_t>(next() % 100000),
                        static_cast<int64_t>(next() % 200000));
    if (id > 2) s.parents = {1 + next() % (id - 1), 1 + next() % (id - 1)};
    if (s.parents.size() == 2 && s.parents[0] == s.parents[1]) {
      s.parents.pop_back();
    }
    s.flags.evict_pinned = next() % 11 == 0;
    s.flags.offload_pinned = next() % 13 == 0;
    s.flags.uncomputable = next() % 17 == 0;
    AddAt(table, s, static_cast<int64_t>(next() % 1000));
  }
  for (TensorId id = 1; id <= 300; id += 3) {
    const TensorFlags f = table.Find(id)->flags;
    if (f.uncomputable || f.evict_pinned) continue;  // cannot be evicted
    ASSERT_TRUE(table.SetState(id, TensorState::kEvicted).ok());
  }
}

TEST(HeuristicTest, ScoreLowerBoundIsNeverAboveTheScore) {
  TensorTable table;
  FillWithEvictedNeighbours(table);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {1e9, 2e9}).ok());
  costs.SetOffloadBacklog(0, 50000);
  const MegEngineParams me;
  constexpr int64_t kNow = 5000;
  const Scope gpu = kGpu0;
  int looser = 0;  // where the walk added to the bound: the test's point
  for (Heuristic h :
       {Heuristic::kDelta, Heuristic::kLru, Heuristic::kGreedy, Heuristic::kDtr,
        Heuristic::kDtrEq, Heuristic::kMegEngine, Heuristic::kDeltaCost}) {
    for (uint32_t slot : table.Candidates(gpu)) {
      const double score = Score(h, me, table, slot, kNow, &costs);
      const double bound = ScoreLowerBound(h, me, table, slot, kNow, &costs);
      EXPECT_LE(bound, score) << HeuristicName(h) << " slot " << slot;
      const bool exact = h == Heuristic::kDelta || h == Heuristic::kLru ||
                         h == Heuristic::kGreedy || !HasLowerBound(h);
      if (exact) {
        EXPECT_EQ(bound, score) << HeuristicName(h);
      } else if (bound < score) {
        ++looser;
      }
    }
  }
  EXPECT_GT(looser, 10);
  EXPECT_TRUE(HasLowerBound(Heuristic::kDeltaCost));
  EXPECT_TRUE(HasLowerBound(Heuristic::kDelta));
  EXPECT_FALSE(HasLowerBound(Heuristic::kMegEngine));
}

TEST(HeuristicTest, EntryBoundOfTheCandidateListEqualsTheTensorsBound) {
  TensorTable table;
  FillWithEvictedNeighbours(table);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {1e9, 2e9}).ok());
  constexpr int64_t kNow = 5000;
  // Touches after the adds change what the entries must mirror.
  for (TensorId id = 2; id <= 300; id += 7) {
    if (table.Find(id)->state == TensorState::kResident) {
      ASSERT_TRUE(table.Touch(id, 4000 + static_cast<int64_t>(id)).ok());
    }
  }
  int checked = 0;
  for (Heuristic h :
       {Heuristic::kDelta, Heuristic::kDtrEq, Heuristic::kDeltaCost}) {
    for (const CandidateEntry& e : table.CandidateEntries(kGpu0)) {
      EXPECT_EQ(EntryBound(h, e, 0, kNow, &costs),
                ScoreLowerBound(h, {}, table, e.slot, kNow, &costs))
          << HeuristicName(h) << " slot " << e.slot;
      ++checked;
    }
  }
  EXPECT_GT(checked, 300);
}

}  // namespace
}  // namespace deltad::policy
