// Tests of GpuPolicy's batches: all or nothing, each event's effect,
// limits, bounded costs and what a batch reports for the metrics.

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

// --- All or nothing ----------------------------------------------------------

class GpuPolicyBatchTest : public GpuPolicyTest {
 protected:
  void SetUp() override {
    Make(10000);
    AddSession(kA, 10000);
    Fill(kA, 1, 1, 100);
  }
  // Creates 2 and 3 (3 a child of 2), then uses and releases 1 and 2.
  static v1::EventBatch GoodBatch() {
    v1::EventBatch batch;
    AddCreated(batch, 3, 300, Cost::kCheap, {2});  // parent later in batch
    AddCreated(batch, 2, 200);
    AddEvent(batch, kAccessed, 1);
    AddEvent(batch, kOffloaded, 1);
    AddEvent(batch, kReloaded, 1);
    AddEvent(batch, kEvicted, 2);
    AddEvent(batch, kFreed, 3);
    return batch;
  }
};

TEST_F(GpuPolicyBatchTest, AnErrorInTheLastEventAppliesNothing) {
  const std::string before = AllUsage();
  struct Case {
    int kind;
    uint64_t id;
    absl::StatusCode code;
  };
  for (const Case& c : {
           Case{kAccessed, 99, absl::StatusCode::kNotFound},
           Case{v1::TensorEvent::KIND_UNSPECIFIED, 1,
                absl::StatusCode::kInvalidArgument},
           Case{42, 1, absl::StatusCode::kInvalidArgument},
           // 2 was evicted by this very batch: it cannot be accessed.
           Case{kAccessed, 2, absl::StatusCode::kFailedPrecondition},
           // 3 was freed by this very batch.
           Case{kAccessed, 3, absl::StatusCode::kNotFound},
       }) {
    v1::EventBatch batch = GoodBatch();
    AddEvent(batch, c.kind, c.id);
    const absl::Status s = Apply(kA, batch);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(absl::StrCat("tensor ", c.id)));
    EXPECT_EQ(AllUsage(), before) << s;
  }
  // Nothing of it was applied: the very same batch, without the error,
  // creates 2 and 3 (no "already exists") and moves 1 as it says.
  const absl::Status s = Apply(kA, GoodBatch());
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(U(kA).device_bytes, 100);  // 1 back; 2 evicted; 3 freed
  EXPECT_EQ(U(kA).tensors, 2);
}

TEST_F(GpuPolicyBatchTest, BadCreationsAreRejectedWithTheirReason) {
  const std::string before = AllUsage();
  struct Case {
    std::string name;
    v1::EventBatch batch;
    absl::StatusCode code;
    std::string says;
  };
  std::vector<Case> cases;
  {
    Case c{"zero size", {}, absl::StatusCode::kInvalidArgument, "tensor 5"};
    AddCreated(c.batch, 5, 0);
    cases.push_back(c);
  }
  {
    Case c{"larger than GPU",
           {},
           absl::StatusCode::kInvalidArgument,
           "whole budget"};
    AddCreated(c.batch, 5, 10001);
    cases.push_back(c);
  }
  {
    Case c{"too many parents",
           {},
           absl::StatusCode::kInvalidArgument,
           "the most is 4096"};
    AddCreated(c.batch, 5, 10, Cost::kCheap, std::vector<uint64_t>(4097, 1));
    cases.push_back(c);
  }
  {
    Case c{"negative cost",
           {},
           absl::StatusCode::kInvalidArgument,
           "compute cost"};
    AddCreated(c.batch, 5, 10);
    c.batch.mutable_created(0)->set_compute_cost_ns(-1);
    cases.push_back(c);
  }
  {
    Case c{"existing id", {}, absl::StatusCode::kAlreadyExists, "tensor 1"};
    AddCreated(c.batch, 1, 10);
    cases.push_back(c);
  }
  {
    Case c{"twice in batch", {}, absl::StatusCode::kAlreadyExists, "tensor 5"};
    AddCreated(c.batch, 5, 10);
    AddCreated(c.batch, 5, 10);
    cases.push_back(c);
  }
  {
    Case c{"unknown parent", {}, absl::StatusCode::kNotFound, "parent 9"};
    AddCreated(c.batch, 5, 10, Cost::kCheap, {9});
    cases.push_back(c);
  }
  {
    Case c{"own parent", {}, absl::StatusCode::kInvalidArgument, "cycle"};
    AddCreated(c.batch, 5, 10, Cost::kCheap, {5});
    cases.push_back(c);
  }
  {
    Case c{"cycle", {}, absl::StatusCode::kInvalidArgument, "cycle"};
    AddCreated(c.batch, 5, 10, Cost::kCheap, {1, 6});
    AddCreated(c.batch, 6, 10, Cost::kCheap, {5});
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    // A good creation ahead of the bad one must not land either.
    v1::EventBatch batch;
    AddCreated(batch, 4, 400);
    batch.MergeFrom(c.batch);
    const absl::Status s = Apply(kA, batch);
    EXPECT_EQ(s.code(), c.code) << c.name << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.says)) << c.name;
    EXPECT_EQ(AllUsage(), before) << c.name;
  }
}

// --- Each event's effect -----------------------------------------------------

TEST_F(GpuPolicyTest, EachEventKindMovesBytesAsItSays) {
  Make(10000);
  AddSession(kA, 10000);
  Fill(kA, 1, 1, 100);
  auto expect = [&](int64_t device, int64_t host, int64_t tensors) {
    const SessionUsage u = U(kA);
    EXPECT_EQ(u.device_bytes, device) << UsageString(u);
    EXPECT_EQ(u.host_bytes, host) << UsageString(u);
    EXPECT_EQ(u.tensors, tensors) << UsageString(u);
    EXPECT_EQ(policy_->device_bytes(), device);
  };
  expect(100, 0, 1);
  ASSERT_TRUE(Apply(kA, Events({{kAccessed, 1}})).ok());
  expect(100, 0, 1);
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}})).ok());
  expect(0, 100, 1);
  ASSERT_TRUE(Apply(kA, Events({{kReloaded, 1}})).ok());
  expect(100, 0, 1);
  ASSERT_TRUE(Apply(kA, Events({{kEvicted, 1}})).ok());
  expect(0, 0, 1);
  ASSERT_TRUE(Apply(kA, Events({{kRecomputed, 1}})).ok());
  expect(100, 0, 1);
  // Offloaded, then rebuilt by recompute instead of a reload.
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}, {kRecomputed, 1}})).ok());
  expect(100, 0, 1);
  // Offloaded, then its host copy dropped.
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}, {kEvicted, 1}})).ok());
  expect(0, 0, 1);
  ASSERT_TRUE(Apply(kA, Events({{kRecomputed, 1}, {kFreed, 1}})).ok());
  expect(0, 0, 0);
}

TEST_F(GpuPolicyTest, EventsFollowTheDaemonsOrders) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 10, 100, Cost::kCostly);  // the GPU is full
  auto orders = MakeRoom(kA, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT((*orders)[kA], ElementsAre(::testing::_));
  const v1::ReleaseOrder order = (*orders)[kA][0];
  EXPECT_EQ(order.action(), v1::ReleaseOrder::OFFLOAD);
  EXPECT_EQ(order.tensor_id(), 1u);  // the stalest
  // Ordered: no longer committed, its copy on the way.
  EXPECT_EQ(U(kA).device_bytes, 900);
  EXPECT_EQ(U(kA).host_bytes, 100);
  // The process could not do it: back to resident.
  ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, 1}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 1000);
  EXPECT_EQ(U(kA).host_bytes, 0);
  // Ordered again and carried out this time.
  orders = MakeRoom(kA, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 900);
  EXPECT_EQ(U(kA).host_bytes, 100);
  EXPECT_EQ(U(kA).releases_ordered, 2u);
  // A refusal with no order outstanding is stale (the process overtook the
  // order, or freed the tensor): it changes nothing and the batch stands.
  ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, 2}, {kFreed, 3}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 800);
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 4}, {kReleaseFailed, 4}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 700);
}

TEST_F(GpuPolicyTest,
       AnEvictionOvertakingAnOffloadOrderStandsAndItsRefusalIsStale) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 10, 100, Cost::kCostly);  // the GPU is full
  auto orders = MakeRoom(kA, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_EQ((*orders)[kA].size(), 1u);
  ASSERT_EQ((*orders)[kA][0].action(), v1::ReleaseOrder::OFFLOAD);
  const uint64_t id = (*orders)[kA][0].tensor_id();
  // The process's own plan evicted it before the order reached it.
  ASSERT_TRUE(Apply(kA, Events({{kEvicted, id}, {kFreed, 10}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 800);
  EXPECT_EQ(U(kA).host_bytes, 0);
  // It then refuses the order: nothing to cancel, the tensor stays evicted.
  ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, id}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 800);
  EXPECT_EQ(U(kA).host_bytes, 0);
  ASSERT_TRUE(Apply(kA, Events({{kRecomputed, id}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 900);
}

TEST_F(GpuPolicyTest, AnEvictOrderIsConfirmedOrCancelled) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 10, 100);  // cheap: evicted
  auto orders = MakeRoom(kA, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_EQ((*orders)[kA].size(), 1u);
  EXPECT_EQ((*orders)[kA][0].action(), v1::ReleaseOrder::EVICT);
  EXPECT_EQ(U(kA).device_bytes, 900);
  ASSERT_TRUE(Apply(kA, Events({{kEvicted, 1}})).ok());  // done
  EXPECT_EQ(U(kA).device_bytes, 900);
  ASSERT_TRUE(Apply(kA, Events({{kRecomputed, 1}})).ok());
  orders = MakeRoom(kA, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  const uint64_t id = (*orders)[kA][0].tensor_id();
  ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, id}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 1000);
}

TEST_F(GpuPolicyTest, AnAccessRacingAnEvictOrderKeepsTheRestOfTheBatch) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 10, 100);  // cheap: evicted
  auto orders = MakeRoom(kA, 100);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_EQ((*orders)[kA].size(), 1u);
  const uint64_t id = (*orders)[kA][0].tensor_id();
  const uint64_t other = id == 1 ? 2 : 1;
  // The process used the tensor before it saw the order, then refuses it.
  ASSERT_TRUE(Apply(kA, Events({{kAccessed, id}, {kFreed, other}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 800);  // the free was applied
  ASSERT_TRUE(Apply(kA, Events({{kReleaseFailed, id}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 900);
}

TEST_F(GpuPolicyTest, ACopyMadeAheadMakesItsTensorTheCheaperRelease) {
  GpuPolicyOptions o = Options();
  o.filter.heuristic = policy::Heuristic::kDeltaCost;  // the config default
  Make(1000, o);
  AddSession(kA, 1000);
  Fill(kA, 1, 10, 100, Cost::kCostly, {.uncomputable = true});  // full
  auto stalest_goes = [&](uint64_t want, uint64_t refill) {
    auto orders = MakeRoom(kA, 100);
    ASSERT_TRUE(orders.ok()) << orders.status();
    ASSERT_THAT((*orders)[kA], ElementsAre(::testing::_));
    EXPECT_EQ((*orders)[kA][0].tensor_id(), want);
    EXPECT_EQ((*orders)[kA][0].action(), v1::ReleaseOrder::OFFLOAD);
    ASSERT_TRUE(Apply(kA, Events({{kOffloaded, want}})).ok());
    Fill(kA, refill, 1, 100, Cost::kCostly, {.uncomputable = true});
  };
  stalest_goes(1, 11);
  // A copy reported for a tensor no longer resident is stale and changes
  // nothing. 7's makes its offload cost the reload alone: it goes before
  // the staler 2.
  ASSERT_TRUE(Apply(kA, Events({{kHostCopied, 1}, {kHostCopied, 7}})).ok());
  stalest_goes(7, 12);
  // A copy made and dropped again leaves the price as it was.
  ASSERT_TRUE(
      Apply(kA, Events({{kHostCopied, 8}, {kHostCopyDropped, 8}})).ok());
  stalest_goes(2, 13);
  EXPECT_EQ(U(kA).host_bytes, 300);
}

TEST_F(GpuPolicyTest, OffloadsOfTensorsCopiedAheadTakeHostRoomLikeAnyOther) {
  Make(1000);
  // Room for two: the process's copies lie in the room counted free.
  AddSession(kA, 1000, /*host=*/200);
  Fill(kA, 1, 10, 100, Cost::kCostly, {.uncomputable = true});
  ASSERT_TRUE(Apply(kA, Events({{kHostCopied, 5}, {kHostCopied, 6}})).ok());
  auto orders = MakeRoom(kA, 300);  // three would be over the quota
  EXPECT_FALSE(orders.ok());
  orders = MakeRoom(kA, 200);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_EQ((*orders)[kA].size(), 2u);
  EXPECT_EQ(U(kA).host_bytes, 200);
}

TEST_F(GpuPolicyTest, PinnedTensorsRefuseWhatTheirFlagsForbid) {
  Make(10000);
  AddSession(kA, 10000);
  Flags no_offload;
  no_offload.offload_pinned = true;
  Flags no_evict;
  no_evict.uncomputable = true;
  Fill(kA, 1, 1, 100, Cost::kCheap, no_offload);
  Fill(kA, 2, 1, 100, Cost::kCheap, no_evict);
  EXPECT_TRUE(absl::IsFailedPrecondition(Apply(kA, Events({{kOffloaded, 1}}))));
  EXPECT_TRUE(absl::IsFailedPrecondition(Apply(kA, Events({{kEvicted, 2}}))));
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 2}})).ok());
  EXPECT_TRUE(
      absl::IsFailedPrecondition(Apply(kA, Events({{kRecomputed, 2}}))));
  EXPECT_EQ(U(kA).device_bytes, 100);
}

TEST_F(GpuPolicyTest, AFreedIdCanBeCreatedAgain) {
  Make(10000);
  AddSession(kA, 10000);
  v1::EventBatch batch;
  AddCreated(batch, 1, 100);
  AddCreated(batch, 2, 200, Cost::kCheap, {1});
  ASSERT_TRUE(Apply(kA, batch).ok());
  // 1 is freed but kept: its child 2 may need it to be recomputed.
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 1}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 200);
  EXPECT_TRUE(absl::IsNotFound(Apply(kA, Events({{kAccessed, 1}}))));
  // The process reuses id 1 for a new tensor.
  v1::EventBatch again;
  AddCreated(again, 1, 50);
  ASSERT_TRUE(Apply(kA, again).ok());
  EXPECT_EQ(U(kA).device_bytes, 250);
  EXPECT_EQ(U(kA).tensors, 2);
  // Freeing 2 retires the old 1 too; the new 1 lives on.
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 2}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 50);
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}})).ok());
  EXPECT_EQ(U(kA).host_bytes, 50);
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 1}})).ok());
  EXPECT_EQ(U(kA).host_bytes, 0);
  EXPECT_EQ(U(kA).tensors, 0);
  // And once more, now that nothing of the old ones is left.
  ASSERT_TRUE(Apply(kA, again).ok());
  EXPECT_EQ(U(kA).device_bytes, 50);
}

// --- Limits ----------------------------------------------------------------

TEST_F(GpuPolicyTest, BatchesLargerThanTheLimitAreRefused) {
  GpuPolicyOptions o = Options();
  o.max_batch_events = 3;
  Make(10000, o);
  AddSession(kA, 10000);
  v1::EventBatch batch;
  AddCreated(batch, 1, 10);
  AddCreated(batch, 2, 10);
  AddEvent(batch, kAccessed, 1);
  ASSERT_TRUE(Apply(kA, batch).ok());
  const absl::Status s = Apply(
      kA,
      Events({{kAccessed, 1}, {kAccessed, 1}, {kAccessed, 1}, {kAccessed, 2}}));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("limit is 3"));
}

TEST_F(GpuPolicyTest, SessionsCannotRecordMoreTensorsThanTheLimit) {
  GpuPolicyOptions o = Options();
  o.max_tensors_per_session = 2;
  Make(10000, o);
  AddSession(kA, 10000);
  AddSession(kB, 10000);
  v1::EventBatch batch;
  AddCreated(batch, 1, 10);
  AddCreated(batch, 2, 10, Cost::kCheap, {1});
  ASSERT_TRUE(Apply(kA, batch).ok());
  v1::EventBatch third;
  AddCreated(third, 3, 10);
  absl::Status s = Apply(kA, third);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("limit is 2"));
  // The limit is per session.
  EXPECT_TRUE(Apply(kB, third).ok());
  // 1, freed, is kept for 2's recompute and still counts.
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 1}})).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(Apply(kA, third)));
  // Once both are gone there is room again.
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 2}})).ok());
  EXPECT_TRUE(Apply(kA, third).ok());
}

// Regression: compute costs were unbounded above, and summing INT64_MAX
// costs over an evicted chain overflowed (undefined behaviour, seen under
// UBSan in the union-find's cost sum).
TEST_F(GpuPolicyTest, ComputeCostsAreBoundedSoCostSumsCannotOverflow) {
  Make(1000);
  AddSession(1, 1000);
  v1::EventBatch huge;
  AddCreated(huge, 1, 10);
  huge.mutable_created(0)->set_compute_cost_ns(
      std::numeric_limits<int64_t>::max());
  const absl::Status s = Apply(1, huge);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("compute cost"));
  GpuPolicyOptions options;
  options.max_tensors_per_session = int64_t{1} << 40;
  EXPECT_EQ(GpuPolicy::Create(0, 1000, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuPolicyTest, ABatchReportsWhatItDidForTheMetrics) {
  Make(1000);
  AddSession(1, 1000);
  v1::EventBatch create;
  AddCreated(create, 1, 100, Cost::kCostly);
  AddCreated(create, 2, 200, Cost::kCostly);
  ASSERT_TRUE(Apply(1, create).ok());
  v1::EventBatch events;
  AddEvent(events, v1::TensorEvent::OFFLOADED, 1);  // on its own initiative
  AddEvent(events, v1::TensorEvent::RELOADED, 1);
  AddEvent(events, v1::TensorEvent::EVICTED, 2);
  AddEvent(events, v1::TensorEvent::RECOMPUTED, 2);
  AppliedCounts c;
  ASSERT_TRUE(policy_->Apply(1, events, now_ += 10, &c).ok());
  EXPECT_EQ(c.offloaded_bytes, 100);
  EXPECT_EQ(c.reloaded_bytes, 100);
  EXPECT_EQ(c.evictions, 1);
  EXPECT_EQ(c.recomputes, 1);
  EXPECT_EQ(c.recompute_ns, 100 * 200);  // Cost::kCostly is 100 ns a byte
}

TEST_F(GpuPolicyTest, ConfirmingAnEvictOrderCountsAsAnEviction) {
  Make(1000);
  AddSession(1, 1000);
  v1::EventBatch create;
  AddCreated(create, 1, 600);
  AddCreated(create, 2, 400);
  ASSERT_TRUE(Apply(1, create).ok());
  auto orders = policy_->MakeRoom(1, 100, now_ += 10);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_EQ(orders->at(1).size(), 1u);
  ASSERT_EQ(orders->at(1)[0].action(), v1::ReleaseOrder::EVICT);
  v1::EventBatch confirm;
  AddEvent(confirm, v1::TensorEvent::EVICTED, orders->at(1)[0].tensor_id());
  AppliedCounts c;
  ASSERT_TRUE(policy_->Apply(1, confirm, now_ += 10, &c).ok());
  EXPECT_EQ(c.evictions, 1);
}

}  // namespace
}  // namespace deltad::daemon
