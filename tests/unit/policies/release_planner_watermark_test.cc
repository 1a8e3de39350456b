// The ReleasePlanner driven by the watermark trigger, and its releases
// ahead of need (OffloadAhead).

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/release_planner.h"
#include "policies/watermarks.h"
#include "tests/unit/policies/release_planner_test_helpers.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;

// --- With the watermark trigger ---------------------------------------------

constexpr int64_t kBudget = 10000;
constexpr int64_t kLowBytes = 6500;   // 65%
constexpr int64_t kHighBytes = 7500;  // 75%

TEST_F(ReleasePlannerTest, WatermarksBringCommittedBytesDownToTheLowMark) {
  absl::StatusOr<Watermarks> marks = Watermarks::Create();
  ASSERT_TRUE(marks.ok()) << marks.status();
  // Fill the session past 75% with a mix of cheap and costly tensors.
  TensorId id = 0;
  while (table_.SessionStats(kSession).committed_bytes() <= kHighBytes) {
    ++id;
    Add(Spec(id, 100, id % 3 ? Kind::kCheap : Kind::kCostly),
        static_cast<int64_t>(id));
  }
  const int64_t used = table_.SessionStats(kSession).committed_bytes();
  ASSERT_EQ(used, 7600);

  absl::StatusOr<int64_t> to_free = marks->BytesToFree(used, 0, kBudget);
  ASSERT_TRUE(to_free.ok()) << to_free.status();
  EXPECT_EQ(*to_free, used - kLowBytes);
  absl::StatusOr<std::vector<ReleaseOrder>> orders = Release(*to_free);
  ASSERT_TRUE(orders.ok()) << orders.status();

  const MemoryStats s = table_.SessionStats(kSession);
  EXPECT_EQ(s.committed_bytes(), kLowBytes);
  // Offloads still in flight hold device memory but no longer count.
  EXPECT_GT(s.releasing_bytes, 0);
  EXPECT_EQ(s.device_bytes, kLowBytes + s.releasing_bytes);
  to_free = marks->BytesToFree(s.committed_bytes(), 0, kBudget);
  ASSERT_TRUE(to_free.ok()) << to_free.status();
  EXPECT_EQ(*to_free, 0);
}

TEST_F(ReleasePlannerTest, WatermarksTriggerRarelyAndKeepUseUnderTheHighMark) {
  absl::StatusOr<Watermarks> marks = Watermarks::Create();
  ASSERT_TRUE(marks.ok()) << marks.status();
  constexpr int64_t kTensor = 100;
  int triggers = 0;
  for (TensorId id = 1; id <= 300; ++id) {
    const int64_t now = static_cast<int64_t>(id);
    const int64_t used = table_.SessionStats(kSession).committed_bytes();
    absl::StatusOr<int64_t> to_free =
        marks->BytesToFree(used, kTensor, kBudget);
    ASSERT_TRUE(to_free.ok()) << to_free.status();
    if (*to_free > 0) {
      ++triggers;
      absl::StatusOr<std::vector<ReleaseOrder>> orders =
          planner_.Release(SessionScope(kSession), *to_free, now, kPlenty);
      ASSERT_TRUE(orders.ok()) << orders.status();
      // The executor finishes the copies.
      for (const ReleaseOrder& o : *orders) {
        if (o.action == kOffload) {
          ASSERT_TRUE(table_.SetState(o.id, TensorState::kOffloaded).ok());
        }
      }
      ASSERT_LE(table_.SessionStats(kSession).committed_bytes() + kTensor,
                kLowBytes)
          << "at tensor " << id;
    }
    Add(Spec(id, kTensor, id % 3 ? Kind::kCheap : Kind::kCostly), now);
    ASSERT_LE(table_.SessionStats(kSession).device_bytes, kHighBytes)
        << "at tensor " << id;
  }
  // From 75% down to 65% of 10000 bytes leaves room for 10 tensors of 100
  // bytes between triggers: (300 - 75) / 11 triggers or so, not one per
  // allocation.
  EXPECT_GE(triggers, 15);
  EXPECT_LE(triggers, 25);
}

TEST_F(ReleasePlannerTest,
       OffloadAheadOffloadsOnlyWhatTheDirectorWouldOffload) {
  // Odd ids are cheap to recompute (evict), even ones dear (offload).
  for (TensorId id = 1; id <= 6; ++id) {
    Add(Spec(id, 100, id % 2 ? Kind::kCheap : Kind::kCostly), id);
  }
  const std::vector<ReleaseOrder> orders =
      planner_.OffloadAhead(SessionScope(kSession), 250, kNow, kPlenty);
  EXPECT_EQ(Bytes(orders), 300);
  for (const ReleaseOrder& o : orders) {
    EXPECT_EQ(o.action, kOffload);
    EXPECT_EQ(o.id % 2, 0u) << o.id;
    EXPECT_EQ(State(o.id), TensorState::kOffloading);
  }
  for (TensorId id : {1, 3, 5}) EXPECT_EQ(State(id), TensorState::kResident);
}

TEST_F(ReleasePlannerTest, OffloadAheadIsBestEffort) {
  Add(Spec(1, 100, Kind::kCostly), 1);
  Add(Spec(2, 100, Kind::kCheap), 2);
  // Asks for far more than the one offloadable tensor: no error, just it.
  EXPECT_THAT(
      Ids(planner_.OffloadAhead(SessionScope(kSession), 10000, kNow, kPlenty)),
      ElementsAre(1));
  // Nothing to offload with no host memory.
  EXPECT_TRUE(
      planner_.OffloadAhead(SessionScope(kSession), 100, kNow, 0).empty());
}

TEST_F(ReleasePlannerTest,
       OffloadAheadStopsWhenTheLinkQueueOutpricesRecompute) {
  // c_r = 10 ns/byte = 1000 ns per tensor. The k-th planned offload queues
  // behind the k-1 before it: (k-1)*100 + 100 ns out, 100 ns back, so
  // F = 1000 / (100k + 100) stays above 1 for k <= 8; the ninth (F = 1)
  // would be evicted, so offloading ahead stops there.
  for (TensorId id = 1; id <= 20; ++id) Add(Spec(id, 100, Kind::kCostly), id);
  const std::vector<ReleaseOrder> orders =
      planner_.OffloadAhead(SessionScope(kSession), 2000, kNow, kPlenty);
  EXPECT_EQ(orders.size(), 8u);
}

}  // namespace
}  // namespace deltad::policy
