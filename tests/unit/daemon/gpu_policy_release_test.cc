// Tests of GpuPolicy's releases: MakeRoom (who may lose tensors, host
// quotas), Plan (early offloads and prefetches).

#include <cstdint>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "daemon/gpu_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/gpu_policy_fixture.h"

namespace deltad::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// --- MakeRoom --------------------------------------------------------------

TEST_F(GpuPolicyTest, MakeRoomReleasesNothingWhileTheGpuHasRoom) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 1, 7, 100);  // above its share of 500
  auto orders = MakeRoom(kA, 300);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(*orders, IsEmpty());
  EXPECT_EQ(U(kA).device_bytes, 700);
}

TEST_F(GpuPolicyTest, MakeRoomTakesAnOverShareSessionsTensorsFirst) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  // B's tensors are the stalest, so the Filter alone would take them; A
  // holds 700, 200 above its share, and must give first.
  Fill(kB, 1, 3, 50);
  Fill(kA, 1, 7, 100);
  Fill(kB, 4, 3, 50);
  const std::string b_before = UsageString(U(kB));
  auto orders = MakeRoom(kB, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kA));
  // A's own ids, A's stalest first.
  EXPECT_THAT(Ids((*orders)[kA]), ElementsAre(1));
  EXPECT_EQ((*orders)[kA][0].bytes(), 100);
  EXPECT_EQ(U(kA).device_bytes, 600);
  EXPECT_EQ(U(kA).releases_ordered, 1u);
  EXPECT_EQ(UsageString(U(kB)), b_before);
}

TEST_F(GpuPolicyTest, MakeRoomTakesOverShareSessionsFirstThenTheRequester) {
  Make(1500);
  AddSession(kA, 500);
  AddSession(kB, 500);
  AddSession(kC, 500);
  Flags pinned;
  pinned.evict_pinned = pinned.offload_pinned = true;
  Fill(kC, 1, 5, 100);                        // at its share, stalest
  Fill(kB, 1, 2, 100);                        // staler than A's
  Fill(kA, 1, 6, 100, Cost::kCheap, pinned);  // 200 above its share...
  Fill(kA, 7, 1, 100);                        // ...100 of it releasable
  const std::string c_before = UsageString(U(kC));
  // B will hold 550: the GPU lacks 250. B's excess of 50 is smaller than
  // any of its tensors, so A gives first what it can, then B a whole
  // tensor for its 50; C, at its share, nothing. The 100 of A's pinned
  // excess are A's: B loses no second tensor for them.
  auto orders = MakeRoom(kB, 350);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kA, kB));
  EXPECT_THAT(Ids((*orders)[kA]), ElementsAre(7));
  EXPECT_THAT(Ids((*orders)[kB]), ElementsAre(1));
  EXPECT_EQ(UsageString(U(kC)), c_before);
}

TEST_F(GpuPolicyTest, MakeRoomTakesAnOverShareSessionOnlyDownToItsShare) {
  // Budgets above the GPU's in sum (as while the arbiter rebalances).
  Make(1300);
  AddSession(kA, 500);
  AddSession(kB, 700);
  AddSession(kC, 300);
  Fill(kC, 1, 3, 100);  // at its share, and the stalest of all
  Fill(kA, 1, 7, 100);  // 200 above its share
  Fill(kB, 1, 3, 100);  // within its share, with the 400 it asks for
  const std::string c_before = UsageString(U(kC));
  auto orders = MakeRoom(kB, 400);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kA, kB));
  EXPECT_THAT(Ids((*orders)[kA]), ElementsAre(1, 2));
  EXPECT_THAT(Ids((*orders)[kB]), ElementsAre(1, 2));
  EXPECT_EQ(U(kA).device_bytes, 500);  // down to its share, no further
  EXPECT_EQ(U(kB).device_bytes, 100);
  EXPECT_EQ(policy_->device_bytes() + 400, 1300);
  EXPECT_EQ(UsageString(U(kC)), c_before);
}

TEST_F(GpuPolicyTest, ASessionWithinItsShareNeverLosesTensorsToAnother) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 1, 5, 100);  // exactly its share, and stalest
  Flags pinned;
  pinned.evict_pinned = pinned.offload_pinned = true;
  Fill(kB, 1, 4, 100, Cost::kCheap, pinned);
  Fill(kB, 5, 1, 100);
  // B asks for 200: only its own one releasable tensor may go.
  const std::string before = AllUsage();
  auto orders = MakeRoom(kB, 200);
  ASSERT_FALSE(orders.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(orders.status())) << orders.status();
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("can free at most 100 bytes"));
  EXPECT_EQ(AllUsage(), before);
  // 100 it can have, from itself.
  orders = MakeRoom(kB, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(Keys(*orders), ElementsAre(kB));
  EXPECT_EQ(U(kA).device_bytes, 500);
}

TEST_F(GpuPolicyTest, MakeRoomThatCannotBeMadeChangesNothing) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 1, 6, 100);  // 100 above its share
  Flags pinned;
  pinned.evict_pinned = pinned.offload_pinned = true;
  Fill(kB, 1, 3, 100, Cost::kCheap, pinned);
  Fill(kB, 4, 1, 100);
  // Needs 400: A may give 100, B itself 100.
  const std::string before = AllUsage();
  auto orders = MakeRoom(kB, 400);
  ASSERT_FALSE(orders.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(orders.status())) << orders.status();
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("can free at most 200 bytes"));
  EXPECT_EQ(AllUsage(), before);
  EXPECT_EQ(U(kA).releases_ordered, 0u);
  // What it said can be freed, can.
  orders = MakeRoom(kB, 200);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_EQ(Bytes((*orders)[kA]), 100);
  EXPECT_EQ(Bytes((*orders)[kB]), 100);
}

TEST_F(GpuPolicyTest, MakeRoomRejectsBadSizes) {
  Make(1000);
  AddSession(kA, 1000);
  EXPECT_TRUE(absl::IsInvalidArgument(MakeRoom(kA, -1).status()));
  EXPECT_TRUE(absl::IsResourceExhausted(MakeRoom(kA, 1001).status()));
  auto none = MakeRoom(kA, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_THAT(*none, IsEmpty());
}

TEST_F(GpuPolicyTest, OffloadsFitTheOwnersHostQuota) {
  Make(1000);
  AddSession(kA, 500, /*host=*/150);
  AddSession(kB, 500, kPlentyHost);
  Fill(kA, 1, 8, 100, Cost::kCostly);  // would rather be offloaded
  Fill(kB, 1, 2, 100, Cost::kCostly);
  auto orders = MakeRoom(kB, 300);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_EQ((*orders)[kA].size(), 3u);
  // A's quota holds one offload; the rest are evicted.
  EXPECT_EQ((*orders)[kA][0].action(), v1::ReleaseOrder::OFFLOAD);
  EXPECT_EQ((*orders)[kA][1].action(), v1::ReleaseOrder::EVICT);
  EXPECT_EQ((*orders)[kA][2].action(), v1::ReleaseOrder::EVICT);
  EXPECT_EQ(U(kA).host_bytes, 100);
}

TEST_F(GpuPolicyTest, AnotherSessionsHostQuotaIsNotLent) {
  Make(1500);
  AddSession(kA, 500, /*host=*/0);
  AddSession(kB, 500, kPlentyHost);
  AddSession(kC, 500, kPlentyHost);
  Fill(kA, 1, 7, 100, Cost::kCostly);  // 200 above its share, no host
  Fill(kC, 1, 7, 100, Cost::kCostly);  // 200 above its share
  Fill(kB, 1, 1, 100);
  auto orders = MakeRoom(kB, 400);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kA, kC));
  for (const v1::ReleaseOrder& o : (*orders)[kA]) {
    EXPECT_EQ(o.action(), v1::ReleaseOrder::EVICT);
  }
  for (const v1::ReleaseOrder& o : (*orders)[kC]) {
    EXPECT_EQ(o.action(), v1::ReleaseOrder::OFFLOAD);
  }
  EXPECT_EQ(U(kA).host_bytes, 0);
  EXPECT_EQ(U(kC).host_bytes, 200);
}

// --- Plan --------------------------------------------------------------------

TEST_F(GpuPolicyTest, PlanOffloadsAheadAboveTheHighWatermark) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 7, 100, Cost::kCostly);  // 700: below 750
  EXPECT_THAT(Plan(kA), IsEmpty());
  Fill(kA, 8, 1, 100, Cost::kCostly);  // 800: above
  std::map<SessionId, v1::Orders> orders = Plan(kA);
  ASSERT_EQ(orders.size(), 1u);
  // Down to 650: two tensors, the stalest, offloaded.
  EXPECT_THAT(Ids(orders[kA]), ElementsAre(1, 2));
  for (const v1::ReleaseOrder& o : orders[kA].release()) {
    EXPECT_EQ(o.action(), v1::ReleaseOrder::OFFLOAD);
  }
  EXPECT_EQ(U(kA).device_bytes, 600);
  EXPECT_EQ(U(kA).releases_ordered, 2u);
  // Evictions are left for when memory is short.
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 8, 100, Cost::kCheap);
  EXPECT_THAT(Plan(kA), IsEmpty());
}

// A process refuses an order for a tensor it has pinned, which the daemon
// cannot see. Early releases then leave that tensor alone for a while:
// ordering it again at once made the daemon and a process with pinned
// tensors loop, an order and a refusal per batch.
TEST_F(GpuPolicyTest, ARefusedTensorIsNotOrderedAheadAgainAtOnce) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 8, 100, Cost::kCostly);  // 800: above the high watermark
  ASSERT_THAT(Ids(Plan(kA)[kA]), ElementsAre(1, 2));
  ASSERT_TRUE(
      Apply(kA, Events({{kReleaseFailed, 1}, {kReleaseFailed, 2}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 800);
  // The next stalest instead.
  EXPECT_THAT(Ids(Plan(kA)[kA]), ElementsAre(3, 4));
  ASSERT_TRUE(
      Apply(kA, Events({{kReleaseFailed, 3}, {kReleaseFailed, 4}})).ok());
  // Past the back-off, 1 and 2 may go again.
  now_ += 25'000'000;
  EXPECT_THAT(Ids(Plan(kA)[kA]), ElementsAre(1, 2));
}

TEST_F(GpuPolicyTest, StreamOrdersStillOutstandingAreRepeatedOnceOnRequest) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 8, 100, Cost::kCostly);  // 800: above the high watermark
  std::map<SessionId, v1::Orders> orders = Plan(kA);
  ASSERT_THAT(Ids(orders[kA]), ElementsAre(1, 2));
  // Tensor 1's copy is done; tensor 2's order is still on its way.
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}})).ok());
  std::vector<v1::ReleaseOrder> repeat = policy_->TakeStreamReleases(kA);
  ASSERT_EQ(repeat.size(), 1u);
  EXPECT_EQ(repeat[0].tensor_id(), 2u);
  EXPECT_EQ(repeat[0].action(), v1::ReleaseOrder::OFFLOAD);
  EXPECT_EQ(repeat[0].bytes(), 100);
  // Once only, and never another session's.
  EXPECT_THAT(policy_->TakeStreamReleases(kA), IsEmpty());
  EXPECT_THAT(policy_->TakeStreamReleases(kB), IsEmpty());
}

TEST_F(GpuPolicyTest, PlanOffloadsAheadFromOverShareSessionsKeyedByOwner) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kB, 1, 2, 100, Cost::kCostly);  // stalest, within its share
  Fill(kA, 1, 6, 100, Cost::kCostly);  // 100 above its share
  std::map<SessionId, v1::Orders> orders = Plan(kB);  // 800 > 750
  // A gives down to its share: 100. B, asking, would hold 700 with A at
  // its share, below the mark: A's excess costs it nothing.
  ASSERT_EQ(orders.size(), 1u);
  EXPECT_THAT(Ids(orders[kA]), ElementsAre(1));
  EXPECT_EQ(policy_->device_bytes(), 700);
  // Planning for A instead: B, within its share, loses nothing.
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kB, 1, 2, 100, Cost::kCostly);
  Fill(kA, 1, 6, 100, Cost::kCostly);
  orders = Plan(kA);
  ASSERT_EQ(orders.size(), 1u);
  EXPECT_THAT(Ids(orders[kA]), ElementsAre(1, 2));
}

TEST_F(GpuPolicyTest, PlanPrefetchesTheSessionsOffloadedTensors) {
  Make(1000);
  AddSession(kA, 1000);
  AddSession(kB, 1000);
  Fill(kA, 1, 4, 100);
  Fill(kB, 1, 2, 100);
  ASSERT_TRUE(Apply(kB, Events({{kOffloaded, 1}, {kOffloaded, 2}})).ok());
  ASSERT_TRUE(
      Apply(kA, Events({{kOffloaded, 1}, {kOffloaded, 2}, {kOffloaded, 3}}))
          .ok());
  EXPECT_EQ(U(kA).device_bytes, 100);
  std::map<SessionId, v1::Orders> orders = Plan(kA);
  // Only A's, newest offloaded first, two in flight at most.
  ASSERT_EQ(orders.size(), 1u);
  EXPECT_THAT(orders[kA].prefetch_tensor_ids(), ElementsAre(3, 2));
  EXPECT_THAT(orders[kA].release(), IsEmpty());
  EXPECT_EQ(U(kA).device_bytes, 300);  // reloads occupy the device
  EXPECT_EQ(U(kB).device_bytes, 0);
  EXPECT_THAT(Plan(kA), IsEmpty());  // two in flight
  ASSERT_TRUE(Apply(kA, Events({{kReloaded, 3}})).ok());
  orders = Plan(kA);
  EXPECT_THAT(orders[kA].prefetch_tensor_ids(), ElementsAre(1));
  ASSERT_TRUE(Apply(kA, Events({{kReloaded, 2}, {kReloaded, 1}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 400);
  EXPECT_EQ(U(kA).host_bytes, 0);
}

TEST_F(GpuPolicyTest, PlanStopsPrefetchingAtTheHighWatermark) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 2, 100);
  Fill(kA, 3, 1, 600);
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}, {kOffloaded, 2}})).ok());
  // 600 held, 750 the mark: room for one 100-byte reload, not two.
  std::map<SessionId, v1::Orders> orders = Plan(kA);
  EXPECT_THAT(orders[kA].prefetch_tensor_ids(), ElementsAre(2));
  // A failed prefetch leaves the tensor offloaded, to be tried again.
  ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, 2}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 600);
  EXPECT_EQ(U(kA).host_bytes, 200);
}

// A refused prefetch is ordered again only after a hold that doubles with
// each refusal in a row: re-queued and ordered by the very batch that
// reported the refusal, one tensor went back and forth thousands of times a
// second.
TEST_F(GpuPolicyTest, ARefusedPrefetchHoldsTheSessionsPrefetchesForABackOff) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 2, 100);
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}, {kOffloaded, 2}})).ok());
  ASSERT_THAT(Plan(kA)[kA].prefetch_tensor_ids(), ElementsAre(2, 1));
  ASSERT_TRUE(
      Apply(kA, Events({{kReleaseFailed, 2}, {kReleaseFailed, 1}})).ok());
  EXPECT_THAT(Plan(kA), IsEmpty());  // two refusals: held 20 ms << 1
  now_ += 30'000'000;
  EXPECT_THAT(Plan(kA), IsEmpty());
  now_ += 15'000'000;
  ASSERT_THAT(Plan(kA)[kA].prefetch_tensor_ids(), ElementsAre(1, 2));
  // A prefetch done ends the run of refusals: the next hold is short.
  ASSERT_TRUE(Apply(kA, Events({{kReloaded, 1}, {kReleaseFailed, 2}})).ok());
  EXPECT_THAT(Plan(kA), IsEmpty());
  now_ += 25'000'000;
  EXPECT_THAT(Plan(kA)[kA].prefetch_tensor_ids(), ElementsAre(2));
  // Refused for ever, it is tried about once every 1.28 s at most.
  ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, 2}})).ok());
  int orders = 0;
  for (int ms = 0; ms < 10'000; ++ms) {
    now_ += 1'000'000;
    if (Plan(kA)[kA].prefetch_tensor_ids_size() == 0) continue;
    ++orders;
    ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, 2}})).ok());
  }
  EXPECT_GE(orders, 7);
  EXPECT_LE(orders, 14);
}

TEST_F(GpuPolicyTest, PrefetchOrderSurvivesALongStayAboveTheMark) {
  Make(10000);
  AddSession(kA, 1000);
  Fill(kA, 1, 1, 1);  // offloaded first, and small enough for any room
  Fill(kA, 2, 2, 100);
  Fill(kA, 4, 1, 800);  // keeps A above its mark of 750
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}})).ok());
  // Many offloads and reloads on demand while no prefetch can be planned.
  for (int i = 0; i < 500; ++i) {
    ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 2}, {kReloaded, 2}})).ok());
    EXPECT_THAT(Plan(kA), IsEmpty());
  }
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 2}, {kOffloaded, 3}})).ok());
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 4}})).ok());
  // Newest offloaded first, and the oldest is still queued.
  EXPECT_THAT(Plan(kA)[kA].prefetch_tensor_ids(), ElementsAre(3, 2));
  ASSERT_TRUE(Apply(kA, Events({{kReloaded, 3}, {kReloaded, 2}})).ok());
  EXPECT_THAT(Plan(kA)[kA].prefetch_tensor_ids(), ElementsAre(1));
}

// Regression: a session only just above its share lost a tensor far larger
// than its excess and ended far below its share, though a small tensor of
// its own would have covered what was needed.
TEST_F(GpuPolicyTest, AnOverShareSessionLosesNoMoreThanItsExcess) {
  Make(1000);
  AddSession(1, 500);
  AddSession(2, 500);
  v1::EventBatch b;
  AddCreated(b, 1, 500);
  AddCreated(b, 2, 10);
  ASSERT_TRUE(Apply(2, b).ok());  // B: 510 against a share of 500
  v1::EventBatch a;
  AddCreated(a, 1, 490);
  ASSERT_TRUE(Apply(1, a).ok());  // the GPU is full
  auto orders = policy_->MakeRoom(1, 10, now_);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_TRUE(orders->contains(2));
  ASSERT_EQ(orders->at(2).size(), 1u);
  EXPECT_EQ(orders->at(2)[0].tensor_id(), 2u);  // the 10-byte one
  EXPECT_EQ(orders->at(2)[0].bytes(), 10);
  EXPECT_FALSE(orders->contains(1));
}

// Four 100-byte tensors with stable keys, read 1, 2, 3, 4 in each
// iteration; iterations 2 (replayed) and 3 (the queue's order) take
// `replay_ms` and `queue_ms`; then 1, 2, 3 are offloaded, as forward
// leaves them, and the next backward starts.
class PrefetchOrderTest : public GpuPolicyTest {
 protected:
  void Trial(int64_t replay_ms, int64_t queue_ms) {
    Make(1000);
    AddSession(kA, 1000);
    v1::EventBatch made;
    for (uint64_t id = 1; id <= 4; ++id) {
      AddCreated(made, id, 100);
      made.mutable_created(static_cast<int>(id) - 1)->set_stable_key(id);
    }
    ASSERT_TRUE(Apply(kA, made).ok());
    int64_t clock = 0;
    for (int64_t ms : {int64_t{10}, replay_ms, queue_ms}) {
      ASSERT_TRUE(Apply(kA, Events({{kAccessed, 1},
                                    {kAccessed, 2},
                                    {kAccessed, 3},
                                    {kAccessed, 4}}))
                      .ok());
      clock += ms * 1000000;
      ASSERT_TRUE(policy_->EndIteration(kA, clock).ok());
    }
    ASSERT_TRUE(
        Apply(kA, Events({{kOffloaded, 1}, {kOffloaded, 2}, {kOffloaded, 3}}))
            .ok());
  }
};

TEST_F(PrefetchOrderTest, AfterAFasterReplayPrefetchesFollowTheLastIteration) {
  Trial(/*replay_ms=*/100, /*queue_ms=*/120);
  // The last iteration read 1 first: 1 and 2 (the window is a quarter of
  // the budget, two tensors), where the queue would take 3 then 2.
  EXPECT_THAT(Plan(kA)[kA].prefetch_tensor_ids(), ElementsAre(1, 2));
}

TEST_F(PrefetchOrderTest, AfterAFasterQueuePrefetchesFollowTheQueue) {
  Trial(/*replay_ms=*/120, /*queue_ms=*/100);
  EXPECT_THAT(Plan(kA)[kA].prefetch_tensor_ids(), ElementsAre(3, 2));
}

TEST_F(GpuPolicyTest, EndIterationOfAnUnknownSessionIsNotFound) {
  Make(1000);
  EXPECT_EQ(policy_->EndIteration(kA, 1).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace deltad::daemon
