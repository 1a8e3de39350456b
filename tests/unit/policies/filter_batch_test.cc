// Tests of Filter::Batch: the picks of one release scored on one sample.

#include <cstdint>
#include <set>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "policies/filter.h"
#include "policies/heuristic.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/filter_test_helpers.h"
#include "tests/unit/policies/tensor_table_test_helpers.h"

namespace deltad::policy {
namespace {

using testing_util::SessionScope;

// `n` tensors of two sessions, the stalest first by id: LRU scores are all
// distinct, and a lower id always scores lower.
void FillStalest(TensorTable& table, int n) {
  for (TensorId id = 1; id <= static_cast<TensorId>(n); ++id) {
    AddAt(table, Spec(id, 100, 0, {}, /*session=*/1 + id % 2), id);
  }
}

// Picks `count` tensors in turn, each excluded from the next search, as a
// release of several tensors does.
std::vector<TensorId> Picks(Filter& filter, const TensorTable& table,
                            const Scope& scope, int count) {
  std::vector<TensorId> picks;
  std::set<TensorId> taken;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<uint32_t> pick =
        filter.Select(table, scope, 1000,
                      [&](const Tensor& t) { return !taken.contains(t.id); });
    EXPECT_TRUE(pick.ok()) << pick.status();
    if (!pick.ok()) break;
    picks.push_back(table.AtSlot(*pick).id);
    taken.insert(picks.back());
  }
  return picks;
}

// How many picks at the start rise in id: in a batch, the best of one
// sample in turn.
size_t RisingRun(const std::vector<TensorId>& picks) {
  size_t n = picks.empty() ? 0 : 1;
  while (n < picks.size() && picks[n] > picks[n - 1]) ++n;
  return n;
}

TEST(FilterBatchTest, PicksInABatchAreTheBestOfOneSampleInTurn) {
  TensorTable table;
  FillStalest(table, 65536);
  Filter filter(Options(Heuristic::kLru, /*sampled=*/true, false, 5));
  std::vector<TensorId> picks;
  {
    Filter::Batch batch(filter);
    picks = Picks(filter, table, kGpu0, 40);
  }
  ASSERT_EQ(picks.size(), 40u);
  EXPECT_EQ(std::set<TensorId>(picks.begin(), picks.end()).size(), 40u);
  // ceil(sqrt(65536)) = 256 draws serve 4 picks, the best of the sample in
  // turn; then a new sample is drawn and the picks go on.
  EXPECT_GE(RisingRun(picks), 4u);
  // Without a batch each pick draws its own sample.
  Filter alone(Options(Heuristic::kLru, /*sampled=*/true, false, 5));
  EXPECT_LT(RisingRun(Picks(alone, table, kGpu0, 40)), 4u);
}

TEST(FilterBatchTest, ASmallSampleServesOnePickAsWithoutABatch) {
  // 400 tensors: 20 draws, fewer than 64 per pick.
  TensorTable table;
  FillStalest(table, 400);
  Filter batched(Options(Heuristic::kLru, /*sampled=*/true, false, 5));
  Filter alone(Options(Heuristic::kLru, /*sampled=*/true, false, 5));
  Filter::Batch batch(batched);
  EXPECT_EQ(Picks(batched, table, kGpu0, 30), Picks(alone, table, kGpu0, 30));
}

TEST(FilterBatchTest, TensorsReleasedSinceTheSampleWasDrawnAreNotPickedAgain) {
  TensorTable table;
  FillStalest(table, 16384);  // 128 draws, 2 picks each
  Filter filter(Options(Heuristic::kLru, /*sampled=*/true, false, 9));
  Filter::Batch batch(filter);
  std::set<TensorId> picked;
  for (int i = 0; i < 40; ++i) {
    // No eligibility to exclude a pick: releasing it must.
    absl::StatusOr<uint32_t> pick =
        filter.Select(table, kGpu0, 1000, [](const Tensor&) { return true; });
    ASSERT_TRUE(pick.ok()) << pick.status();
    const Tensor& t = table.AtSlot(*pick);
    EXPECT_EQ(t.state, TensorState::kResident);
    EXPECT_TRUE(picked.insert(t.id).second) << "picked twice: " << t.id;
    ASSERT_TRUE(table.SetState(t.id, TensorState::kEvicted).ok());
  }
}

TEST(FilterBatchTest, ABatchDrawsAnewForAnotherScope) {
  TensorTable table;
  FillStalest(table, 65536);
  Filter filter(Options(Heuristic::kLru, /*sampled=*/true, false, 3));
  Filter::Batch batch(filter);
  // A sample of the whole GPU, then picks of session 2 alone: each of the
  // latter must be session 2's, though the GPU's sample holds others.
  Picks(filter, table, kGpu0, 3);
  for (TensorId id : Picks(filter, table, SessionScope(0, 2), 10)) {
    EXPECT_EQ(table.Find(id)->session, 2u) << id;
  }
  {
    Filter::Batch nested(filter);  // nesting keeps the sample
    for (TensorId id : Picks(filter, table, SessionScope(0, 1), 5)) {
      EXPECT_EQ(table.Find(id)->session, 1u) << id;
    }
  }
}

}  // namespace
}  // namespace deltad::policy
