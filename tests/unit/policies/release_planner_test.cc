// Tests of the ReleasePlanner (the release loop of DELTA Algorithm 1, lines
// 11-19: Filter picks, Director decides, until enough is freed); the
// watermark trigger driving it and OffloadAhead are in
// release_planner_watermark_test.cc.

#include "policies/release_planner.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/director.h"
#include "policies/filter.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/release_planner_test_helpers.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST_F(ReleasePlannerTest, FreesAtLeastTheBytesAskedAndStopsThere) {
  // Equal sizes: delta releases the stalest first (1, 2, 3, ...).
  for (TensorId id = 1; id <= 10; ++id) Add(Spec(id, 100, Kind::kCheap), id);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(250);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1, 2, 3));
  EXPECT_EQ(Bytes(*orders), 300);
  EXPECT_EQ(table_.SessionStats(kSession).committed_bytes(), 700);

  orders = Release(1);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(4));
}

TEST_F(ReleasePlannerTest, AppliesEvictAndOffloadToTheTable) {
  // Odd ids are cheap to recompute, even ids costly.
  for (TensorId id = 1; id <= 6; ++id) {
    Add(Spec(id, 100, id % 2 ? Kind::kCheap : Kind::kCostly), id);
  }
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(400);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(Actions(*orders),
              ElementsAre(kEvict, kOffload, kEvict, kOffload));
  for (const ReleaseOrder& o : *orders) EXPECT_EQ(o.bytes, 100);
  EXPECT_EQ(State(1), TensorState::kEvicted);
  EXPECT_EQ(State(2), TensorState::kOffloading);
  EXPECT_EQ(State(3), TensorState::kEvicted);
  EXPECT_EQ(State(4), TensorState::kOffloading);
  EXPECT_EQ(State(5), TensorState::kResident);
  const MemoryStats s = table_.SessionStats(kSession);
  EXPECT_EQ(s.device_bytes, 400);     // 2, 4 (leaving), 5, 6
  EXPECT_EQ(s.releasing_bytes, 200);  // 2, 4
  EXPECT_EQ(s.committed_bytes(), 200);
  EXPECT_EQ(s.evicted_bytes, 200);
  EXPECT_EQ(s.host_bytes, 200);
}

// Sizes and access times on which delta and lru disagree. At now = 1000:
//   id  bytes  staleness  m*s
//   1    100       50     5000
//   2    400       20     8000
//   3     50       90     4500
//   4    300       10     3000
class ReleasePlannerOrderTest : public ReleasePlannerTest {
 protected:
  void SetUp() override {
    ReleasePlannerTest::SetUp();
    Add(Spec(1, 100, Kind::kCheap), kNow - 50);
    Add(Spec(2, 400, Kind::kCheap), kNow - 20);
    Add(Spec(3, 50, Kind::kCheap), kNow - 90);
    Add(Spec(4, 300, Kind::kCheap), kNow - 10);
  }
};

TEST_F(ReleasePlannerOrderTest, OrdersFollowTheDeltaFiltersOrder) {
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(850);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(2, 1, 3, 4));
}

TEST_F(ReleasePlannerOrderTest, OrdersFollowTheLruFiltersOrder) {
  Filter lru(Options(Heuristic::kLru));
  ReleasePlanner planner(table_, lru, director_);
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner.Release(SessionScope(kSession), 850, kNow, kPlenty);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(3, 1, 2, 4));
}

// Knowing the next uses (a recorded iteration), delta releases by the
// distance to the next use where it guessed from staleness: of equal
// tensors, the one needed last first; one the record never used before
// all. Staleness alone would take 3, 1, 2, 4.
TEST_F(ReleasePlannerOrderTest, WithNextUsesKnownTheOneNeededLastGoesFirst) {
  // m * distance: 1: 100*5, 2: 400*1, 3: 50*100, 4: not in the record.
  planner_.SetNextUse([](const Tensor& t) -> int64_t {
    switch (t.id) {
      case 1:
        return 5;
      case 2:
        return 1;
      case 3:
        return 100;
      default:
        return -1;
    }
  });
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(850);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(4, 3, 1, 2));
  // Unset, the guess from staleness is back.
  for (TensorId id = 1; id <= 4; ++id) {
    ASSERT_TRUE(table_.CancelRelease(id).ok());
  }
  planner_.SetNextUse(nullptr);
  orders = Release(850);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(2, 1, 3, 4));
}

TEST_F(ReleasePlannerTest, EachReleaseIsSeenByTheNextDecision) {
  // P (stalest) and its child T, both 1000 bytes (c_s = 2000 ns). P's own
  // cost 1000 makes F(P) = 0.5: evicted. T's own cost 1500 would give 0.75,
  // but with P evicted c_r(T) = 2500 and F(T) = 1.25: offloaded.
  TensorSpec p = Spec(1, 1000, Kind::kCheap);
  p.compute_cost_ns = 1000;
  TensorSpec t = Spec(2, 1000, Kind::kCheap, {1});
  t.compute_cost_ns = 1500;
  Add(p, 0);
  Add(t, 1);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(2000);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1, 2));
  EXPECT_THAT(Actions(*orders), ElementsAre(kEvict, kOffload));
}

TEST_F(ReleasePlannerTest, HostBudgetShrinksWithEachOffloadThenEvicts) {
  for (TensorId id = 1; id <= 5; ++id) Add(Spec(id, 100, Kind::kCostly), id);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(500, 250);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1, 2, 3, 4, 5));
  EXPECT_THAT(Actions(*orders),
              ElementsAre(kOffload, kOffload, kEvict, kEvict, kEvict));
  EXPECT_EQ(table_.SessionStats(kSession).host_bytes, 200);
}

TEST_F(ReleasePlannerTest, NegativeHostBudgetMeansNone) {
  for (TensorId id = 1; id <= 2; ++id) Add(Spec(id, 100, Kind::kCostly), id);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(200, -5);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Actions(*orders), ElementsAre(kEvict, kEvict));
}

TEST_F(ReleasePlannerTest, OffloadOnlyTensorsWaitForHostRoom) {
  TensorFlags uncomputable;
  uncomputable.uncomputable = true;
  Add(Spec(1, 100, Kind::kCheap, {}, uncomputable), 0);  // stalest
  Add(Spec(2, 100, Kind::kCheap), 1);
  // No host room: tensor 1 cannot be released, 2 goes instead.
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(100, 0);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(2));
  EXPECT_EQ(State(1), TensorState::kResident);
  // With room it is offloaded.
  orders = Release(100, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1));
  EXPECT_THAT(Actions(*orders), ElementsAre(kOffload));
  EXPECT_EQ(State(1), TensorState::kOffloading);
}

TEST_F(ReleasePlannerTest, HostIsKeptForTensorsThatCanOnlyBeOffloaded) {
  // Tensor 1 (stalest) prefers offload but may be evicted; tensor 2 can only
  // be offloaded. The host has room for one of them: freeing both is
  // possible only by evicting 1 and offloading 2.
  TensorFlags evict_pinned;
  evict_pinned.evict_pinned = true;
  Add(Spec(1, 100, Kind::kCostly), 0);
  Add(Spec(2, 100, Kind::kCostly, {}, evict_pinned), 1);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(200, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_EQ(Bytes(*orders), 200);
  EXPECT_EQ(State(1), TensorState::kEvicted);
  EXPECT_EQ(State(2), TensorState::kOffloading);
}

TEST_F(ReleasePlannerTest, LockedTensorsAreNotReleased) {
  for (TensorId id = 1; id <= 3; ++id) Add(Spec(id, 100, Kind::kCheap), id);
  ASSERT_TRUE(table_.Lock(1).ok());
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(200);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(2, 3));
  EXPECT_EQ(State(1), TensorState::kResident);
}

TEST_F(ReleasePlannerTest, AskingForMoreThanIsResidentIsExhausted) {
  for (TensorId id = 1; id <= 3; ++id) Add(Spec(id, 100, Kind::kCheap), id);
  const std::string before = Snapshot(3);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(301);
  ASSERT_FALSE(orders.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(orders.status())) << orders.status();
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("can free at most 300 bytes"));
  EXPECT_EQ(Snapshot(3), before);
}

// Resident: 2, 3, 4, 5, 6, 7 (100 bytes each) = 600 bytes, of which 4 is
// locked and 5 can only be offloaded. With no host memory, 400 bytes can be
// freed. 1 is evicted already, 3 was recomputed twice.
class ReleasePlannerExhaustedTest : public ReleasePlannerTest {
 protected:
  void SetUp() override {
    ReleasePlannerTest::SetUp();
    TensorFlags evict_pinned;
    evict_pinned.evict_pinned = true;
    Add(Spec(1, 100, Kind::kCheap), 1);
    Add(Spec(2, 100, Kind::kCheap, {1}), 2);
    Add(Spec(3, 100, Kind::kCostly), 3);
    Add(Spec(4, 100, Kind::kCheap), 4);
    Add(Spec(5, 100, Kind::kCheap, {}, evict_pinned), 5);
    Add(Spec(6, 100, Kind::kCheap, {2}), 6);
    Add(Spec(7, 100, Kind::kCostly, {2, 6}), 7);
    ASSERT_TRUE(table_.SetState(1, TensorState::kEvicted).ok());
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(table_.SetState(3, TensorState::kEvicted).ok());
      ASSERT_TRUE(table_.MarkRecomputed(3, 3).ok());
    }
    ASSERT_TRUE(table_.Lock(4).ok());
  }
};

TEST_F(ReleasePlannerExhaustedTest, SaysHowMuchCanBeFreedAndChangesNothing) {
  const std::string before = Snapshot(7);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(450, 0);
  ASSERT_FALSE(orders.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(orders.status())) << orders.status();
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("can free at most 400 bytes"));
  EXPECT_EQ(Snapshot(7), before);
  EXPECT_EQ(table_.Find(3)->recompute_count, 2u);

  // Exactly what it said can be freed, can.
  orders = Release(400, 0);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_EQ(Bytes(*orders), 400);
  EXPECT_EQ(State(4), TensorState::kResident);
  EXPECT_EQ(State(5), TensorState::kResident);
}

TEST_F(ReleasePlannerExhaustedTest, HostRoomMakesThePinnedTensorReleasable) {
  const std::string before = Snapshot(7);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(550, 100);
  ASSERT_FALSE(orders.ok());
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("can free at most 500 bytes"));
  EXPECT_EQ(Snapshot(7), before);
  orders = Release(500, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_EQ(State(5), TensorState::kOffloading);
}

TEST_F(ReleasePlannerExhaustedTest, UpToFreesWhatItCanWhenItCannotFreeAll) {
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner_.ReleaseUpTo(SessionScope(kSession), 450, kNow, 0);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_EQ(Bytes(*orders), 400);
  EXPECT_EQ(State(4), TensorState::kResident);  // locked
  EXPECT_EQ(State(5), TensorState::kResident);  // offload only, no host
  // Nothing left to free: now it is an error, and nothing changes.
  const std::string before = Snapshot(7);
  orders = planner_.ReleaseUpTo(SessionScope(kSession), 100, kNow, 0);
  ASSERT_FALSE(orders.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(orders.status())) << orders.status();
  EXPECT_EQ(Snapshot(7), before);
}

TEST_F(ReleasePlannerTest, UpToFreesNoMoreThanAReleaseOfAllWhenItCan) {
  for (TensorId id = 1; id <= 3; ++id) Add(Spec(id, 100, Kind::kCheap), id);
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner_.ReleaseUpTo(SessionScope(kSession), 150, kNow, kPlenty);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1, 2));
  // More than is resident: all of it.
  orders = planner_.ReleaseUpTo(SessionScope(kSession), 1000, kNow, kPlenty);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(3));
}

TEST_F(ReleasePlannerTest, NonPositiveBytesAreRejected) {
  Add(Spec(1, 100, Kind::kCheap), 0);
  const std::string before = Snapshot(1);
  for (int64_t bytes : {int64_t{0}, int64_t{-1}}) {
    absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(bytes);
    ASSERT_FALSE(orders.ok()) << bytes;
    EXPECT_TRUE(absl::IsInvalidArgument(orders.status())) << orders.status();
  }
  EXPECT_EQ(Snapshot(1), before);
}

TEST_F(ReleasePlannerTest, GpuScopeReleasesOtherSessionsStaleTensors) {
  Add(Spec(1, 100, Kind::kCheap, {}, {}, /*session=*/2), 0);  // stalest
  Add(Spec(2, 100, Kind::kCheap), 1);
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner_.Release(GpuScope(0), 100, kNow, kPlenty);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1));
  orders = Release(100);  // session scope: only session 1's
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(2));
}

// --- With an eligibility check ----------------------------------------------

TEST_F(ReleasePlannerTest, ReleaseTakesOnlyEligibleTensors) {
  // Equal sizes: the Filter's order is 1, 2, 3, ...; only even ids allowed.
  for (TensorId id = 1; id <= 6; ++id) Add(Spec(id, 100, Kind::kCheap), id);
  auto even = [](const Tensor& t) { return t.id % 2 == 0; };
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner_.Release(SessionScope(kSession), 200, kNow, kPlenty, even);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(2, 4));
  for (TensorId id : {1, 3, 5, 6}) EXPECT_EQ(State(id), TensorState::kResident);
}

TEST_F(ReleasePlannerTest, ReleaseWithTooFewEligibleBytesChangesNothing) {
  for (TensorId id = 1; id <= 6; ++id) Add(Spec(id, 100, Kind::kCheap), id);
  auto even = [](const Tensor& t) { return t.id % 2 == 0; };
  const std::string before = Snapshot(6);
  // 600 bytes are resident, but only the 300 of even ids may go.
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner_.Release(SessionScope(kSession), 400, kNow, kPlenty, even);
  ASSERT_FALSE(orders.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(orders.status())) << orders.status();
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("can free at most 300 bytes"));
  EXPECT_EQ(Snapshot(6), before);
}

TEST_F(ReleasePlannerTest, EligibilityDoesNotOverrideTheDirector) {
  // Tensor 1 (stalest) is eligible but can only be offloaded, and there is
  // no host memory: the Director's check still excludes it.
  TensorFlags uncomputable;
  uncomputable.uncomputable = true;
  Add(Spec(1, 100, Kind::kCheap, {}, uncomputable), 0);
  Add(Spec(2, 100, Kind::kCheap), 1);
  auto all = [](const Tensor&) { return true; };
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner_.Release(SessionScope(kSession), 100, kNow, 0, all);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(2));
  EXPECT_EQ(State(1), TensorState::kResident);
}

TEST_F(ReleasePlannerTest, EligibilityIsReadAgainAtEachPick) {
  // Allow session 2's tensors only while session 2 holds more than 150
  // bytes: one of its tensors goes, then session 1's.
  Add(Spec(1, 100, Kind::kCheap, {}, {}, /*session=*/2), 0);
  Add(Spec(2, 100, Kind::kCheap, {}, {}, /*session=*/2), 1);
  Add(Spec(3, 100, Kind::kCheap), 2);
  auto capped = [this](const Tensor& t) {
    return t.session != 2 || table_.SessionStats(2).committed_bytes() > 150;
  };
  absl::StatusOr<std::vector<ReleaseOrder>> orders =
      planner_.Release(GpuScope(0), 200, kNow, kPlenty, capped);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Ids(*orders), ElementsAre(1, 3));
  EXPECT_EQ(State(2), TensorState::kResident);
}

TEST_F(ReleasePlannerTest, OffloadAheadTakesOnlyEligibleTensors) {
  for (TensorId id = 1; id <= 6; ++id) Add(Spec(id, 100, Kind::kCostly), id);
  auto above_three = [](const Tensor& t) { return t.id > 3; };
  const std::vector<ReleaseOrder> orders = planner_.OffloadAhead(
      SessionScope(kSession), 10000, kNow, kPlenty, above_three);
  EXPECT_THAT(Ids(orders), ElementsAre(4, 5, 6));
  for (TensorId id : {1, 2, 3}) EXPECT_EQ(State(id), TensorState::kResident);
}

}  // namespace
}  // namespace deltad::policy
