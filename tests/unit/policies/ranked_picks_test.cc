// Tests of the exact picks a Filter takes from a ranking in a Batch
// (RankedCandidates): the same tensors a scan of every candidate picks,
// as releases raise scores and move entries, and whatever else changes.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
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

constexpr Heuristic kBounded[] = {Heuristic::kDelta,  Heuristic::kLru,
                                  Heuristic::kGreedy, Heuristic::kDtr,
                                  Heuristic::kDtrEq,  Heuristic::kDeltaCost};
constexpr int64_t kNow = 50;

// Scores that tie often (two sizes, three access times, costs of
// `least_cost` to 1500 ns, swaps of 500 or 1000 ns at 4 GB/s), one parent
// each, a fifth evicted, some pinned one way or without a recompute path.
void FillTying(TensorTable& table, int n, uint64_t seed,
               int64_t least_cost = 0) {
  TestLcg next(seed);
  for (TensorId id = 1; id <= static_cast<TensorId>(n); ++id) {
    std::vector<TensorId> parents;
    if (id > 1 && next() % 4 != 0) parents.push_back(1 + next() % (id - 1));
    TensorSpec spec = Spec(
        id, 1000 * (1 + static_cast<int64_t>(next() % 2)),
        std::max<int64_t>(least_cost, 250 * static_cast<int64_t>(next() % 7)),
        parents);
    const uint64_t kind = next() % 8;
    spec.flags.offload_pinned = kind == 0;
    spec.flags.evict_pinned = kind == 1;
    spec.flags.uncomputable = kind == 2;
    AddAt(table, spec, 10 * static_cast<int64_t>(next() % 3));
  }
  for (TensorId id = 1; id <= static_cast<TensorId>(n); id += 5) {
    const Tensor* t = table.Find(id);
    if (!t->flags.evict_pinned && !t->flags.uncomputable) Evict(table, id);
  }
}

// Releases the pick as a planner would: evicted where it may be (its
// neighbours' recompute costs grow), else offloaded.
void Release(TensorTable& table, uint32_t slot) {
  const Tensor& t = table.AtSlot(slot);
  const TensorState to = t.flags.evict_pinned || t.flags.uncomputable
                             ? TensorState::kOffloading
                             : TensorState::kEvicted;
  ASSERT_TRUE(table.SetState(t.id, to).ok());
}

// Which tensors may go changes from pick to pick, and not only one way:
// every third pick takes any, the others only odd ids or only even ones.
bool EligibleAt(int round, const Tensor& t) {
  switch (round % 3) {
    case 0:
      return true;
    case 1:
      return t.id % 2 == 1;
    default:
      return t.id % 2 == 0;
  }
}

TEST(RankedPicksTest, PicksOfABatchAreWhatAScanOfEveryCandidatePicks) {
  for (Heuristic h : kBounded) {
    TensorTable table;
    FillTying(table, 500, /*seed=*/3);
    CostModel costs;
    ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9}).ok());
    Filter filter(Options(h), &costs);
    Filter::Batch batch(filter);
    for (int round = 0; round < 200; ++round) {
      auto eligible = [round](const Tensor& t) { return EligibleAt(round, t); };
      absl::StatusOr<uint32_t> pick =
          filter.Select(table, kGpu0, kNow, eligible);
      ASSERT_TRUE(pick.ok()) << pick.status();
      ASSERT_EQ(*pick, FirstLowestScore(filter, table, kNow, eligible))
          << HeuristicName(h) << " round " << round;
      // Every fourth pick is not released (a caller may refuse it): it
      // must come up again.
      if (round % 4 != 3) Release(table, *pick);
    }
  }
}

// Anything but a release between two picks can lower a score or bring a
// candidate back: the next pick sees it, as a scan would (at random here;
// each change alone below).
TEST(RankedPicksTest, ChangesBesidesReleasesKeepThePicksThoseOfAScan) {
  TensorTable table;
  // No tensor free to rebuild: the swap's price decides many scores.
  FillTying(table, 400, /*seed=*/5, /*least_cost=*/750);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9}).ok());
  costs.SetOffloadBacklog(0, 4000);
  Filter filter(Options(Heuristic::kDeltaCost), &costs);
  Filter::Batch batch(filter);
  std::vector<TensorId> released;
  for (int round = 0; round < 120; ++round) {
    absl::StatusOr<uint32_t> pick =
        filter.Select(table, kGpu0, kNow, [](const Tensor&) { return true; });
    ASSERT_TRUE(pick.ok()) << pick.status();
    ASSERT_EQ(*pick, FirstLowestScore(filter, table, kNow,
                                      [](const Tensor&) { return true; }))
        << "round " << round;
    released.push_back(table.AtSlot(*pick).id);
    Release(table, *pick);
    switch (round % 6) {
      case 1:  // the last release undone: a candidate again
        ASSERT_TRUE(table.CancelRelease(released.back()).ok());
        released.pop_back();
        break;
      case 2:  // the swap gets cheaper for everyone, or dearer
        costs.SetOffloadBacklog(0, costs.Backlog(0) == 0 ? 4000 : 0);
        break;
      case 3: {  // a copy made ahead: that tensor's swap costs the reload
        const std::vector<uint32_t> c = table.Candidates(kGpu0);
        ASSERT_TRUE(
            table.SetHostCopy(table.AtSlot(c[c.size() / 2]).id, true).ok());
        break;
      }
      case 4: {  // an evicted tensor rebuilt: its neighbours' costs fall
        for (TensorId id = 1; id <= 400; ++id) {
          const Tensor* t = table.Find(id);
          if (t != nullptr && t->state == TensorState::kEvicted) {
            ASSERT_TRUE(table.MarkRecomputed(id, 10).ok());
            break;
          }
        }
        break;
      }
      case 5: {  // an evicted tensor no child needs is dropped: the same
        for (TensorId id = 400; id >= 1; --id) {
          const Tensor* t = table.Find(id);
          if (t != nullptr && t->state == TensorState::kEvicted &&
              t->live_children == 0) {
            ASSERT_TRUE(table.Free(id).ok());
            break;
          }
        }
        break;
      }
      default:
        break;
    }
  }
}

// More releases between two picks than the ranking follows (entries moved
// from the end of the list into the holes) rank the candidates anew.
TEST(RankedPicksTest, ManyReleasesBetweenTwoPicksAreSeen) {
  TensorTable table;
  FillTying(table, 400, /*seed=*/9);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9}).ok());
  Filter filter(Options(Heuristic::kDtrEq), &costs);
  Filter::Batch batch(filter);
  auto any = [](const Tensor&) { return true; };
  for (int round = 0; round < 30; ++round) {
    absl::StatusOr<uint32_t> pick = filter.Select(table, kGpu0, kNow, any);
    ASSERT_TRUE(pick.ok()) << pick.status();
    ASSERT_EQ(*pick, FirstLowestScore(filter, table, kNow, any))
        << "round " << round;
    // Released here: round tensors from the front of the list, which
    // moves as many from its end.
    const std::vector<uint32_t> c = table.Candidates(kGpu0);
    for (int i = 0; i < round && i + 1 < static_cast<int>(c.size()); ++i) {
      Release(table, c[i]);
    }
  }
}

// Twenty tensors that may only be recomputed (1000 ns each) and one, X,
// that a swap or a recompute of `x_cost` and its evicted child (50 us)
// brings back, its swap dear behind a backlog: the twenty go first. Picks
// are made and ranked, then `change` makes X the cheapest: the next pick
// must be X.
void ExpectSeen(Heuristic h, int64_t x_cost,
                absl::FunctionRef<void(TensorTable&, CostModel&)> change) {
  TensorTable table;
  for (TensorId id = 1; id <= 20; ++id) {
    TensorSpec y = Spec(id, 1000, 1000);
    y.flags.offload_pinned = true;
    AddAt(table, y, 0);
  }
  constexpr TensorId kX = 21;
  AddAt(table, Spec(kX, 1000, x_cost), 0);
  // An evicted child of X, costly to rebuild, which nothing else needs.
  AddAt(table, Spec(22, 1000, 50000, {kX}), 0);
  Evict(table, 22);
  CostModel costs;
  ASSERT_TRUE(costs.SetBandwidth(0, {4e9, 4e9}).ok());
  costs.SetOffloadBacklog(0, 8000);
  Filter filter(Options(h), &costs);
  Filter::Batch batch(filter);
  auto any = [](const Tensor&) { return true; };
  for (int round = 0; round < 3; ++round) {  // the third from the ranking
    absl::StatusOr<uint32_t> pick = filter.Select(table, kGpu0, kNow, any);
    ASSERT_TRUE(pick.ok()) << pick.status();
    ASSERT_NE(table.AtSlot(*pick).id, kX) << "round " << round;
    Release(table, *pick);
  }
  change(table, costs);
  absl::StatusOr<uint32_t> pick = filter.Select(table, kGpu0, kNow, any);
  ASSERT_TRUE(pick.ok()) << pick.status();
  EXPECT_EQ(table.AtSlot(*pick).id, kX);
}

TEST(RankedPicksTest, ASwapMadeCheaperIsSeenByTheNextPick) {
  ExpectSeen(Heuristic::kDeltaCost, 2000, [](TensorTable&, CostModel& costs) {
    costs.SetOffloadBacklog(0, 0);  // X's swap: 500 ns
  });
}

TEST(RankedPicksTest, ACopyMadeAheadIsSeenByTheNextPick) {
  ExpectSeen(Heuristic::kDeltaCost, 2000, [](TensorTable& table, CostModel&) {
    ASSERT_TRUE(table.SetHostCopy(21, true).ok());  // X's swap: 250 ns
  });
}

TEST(RankedPicksTest, AnEvictedNeighbourGoneIsSeenByTheNextPick) {
  // dtr_eq counts X's evicted child in X's cost until it is freed.
  ExpectSeen(Heuristic::kDtrEq, 500, [](TensorTable& table, CostModel&) {
    ASSERT_TRUE(table.Free(22).ok());
  });
}

}  // namespace
}  // namespace deltad::policy
