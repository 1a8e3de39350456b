// Tests of GpuPolicy: one GPU's policy engine shared by the sessions on it.
// Session isolation, all-or-nothing batches, each event's effect, limits,
// cross-session releases (who may lose tensors), early offloads and
// prefetches, session removal, and a randomized run of three sessions.

#include "daemon/gpu_policy.h"

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
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/gpu_policy_fixture.h"

namespace deltad::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// --- Configuration and sessions -------------------------------------------

TEST(GpuPolicyCreate, RejectsBadConfiguration) {
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(-1, 1000, Options()).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(0, 0, Options()).status()));
  GpuPolicyOptions bad_marks = Options();
  bad_marks.low_watermark = 0.9;
  bad_marks.high_watermark = 0.5;
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(0, 1000, bad_marks).status()));
  GpuPolicyOptions no_prefetch = Options();
  no_prefetch.max_prefetch_in_flight = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(
      GpuPolicy::Create(0, 1000, no_prefetch).status()));
  GpuPolicyOptions no_link = Options();
  no_link.link = {0, 1e9};
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(0, 1000, no_link).status()));
}

TEST_F(GpuPolicyTest, SessionsAreAddedOnceAndUnknownOnesAreNotFound) {
  Make(1000);
  AddSession(kA, 500);
  EXPECT_TRUE(absl::IsAlreadyExists(policy_->AddSession(kA, 500, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(policy_->AddSession(kB, -1, 0)));
  EXPECT_TRUE(absl::IsNotFound(policy_->RemoveSession(kB)));
  EXPECT_TRUE(absl::IsNotFound(policy_->SetBudget(kB, 10)));
  EXPECT_TRUE(absl::IsNotFound(policy_->Usage(kB).status()));
  EXPECT_TRUE(absl::IsNotFound(Apply(kB, v1::EventBatch())));
  EXPECT_TRUE(absl::IsNotFound(MakeRoom(kB, 10).status()));
  EXPECT_THAT(Plan(kB), IsEmpty());
  EXPECT_TRUE(absl::IsInvalidArgument(policy_->SetBudget(kA, -1)));
  ASSERT_TRUE(policy_->SetBudget(kA, 700).ok());
  EXPECT_EQ(U(kA).budget_bytes, 700);
}

// --- Isolation -------------------------------------------------------------

TEST_F(GpuPolicyTest, ASessionNamingAnotherSessionsIdGetsNotFound) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 7, 1, 100);
  const std::string before = AllUsage();
  for (Kind kind : {kAccessed, kFreed, kOffloaded, kEvicted, kReleaseFailed}) {
    const absl::Status s = Apply(kB, Events({{kind, 7}}));
    EXPECT_TRUE(absl::IsNotFound(s)) << s;
  }
  v1::EventBatch child;
  AddCreated(child, 8, 100, Cost::kCheap, {7});
  const absl::Status s = Apply(kB, child);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("parent 7"));
  EXPECT_EQ(AllUsage(), before);
  // A's tensor is still A's to use.
  EXPECT_TRUE(Apply(kA, Events({{kOffloaded, 7}})).ok());
}

TEST_F(GpuPolicyTest, TwoSessionsUseTheSameIdsIndependently) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 1, 2, 100);
  Fill(kB, 1, 2, 30);
  EXPECT_EQ(U(kA).device_bytes, 200);
  EXPECT_EQ(U(kB).device_bytes, 60);
  ASSERT_TRUE(Apply(kB, Events({{kFreed, 1}, {kOffloaded, 2}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 200);
  EXPECT_EQ(U(kA).tensors, 2);
  EXPECT_EQ(U(kB).device_bytes, 0);
  EXPECT_EQ(U(kB).host_bytes, 30);
  EXPECT_EQ(U(kB).tensors, 1);
  // A's tensor 1 is untouched by B's free.
  EXPECT_TRUE(Apply(kA, Events({{kAccessed, 1}})).ok());
  // B may create its id 1 again; A's id 1 stays A's.
  v1::EventBatch again;
  AddCreated(again, 1, 40);
  ASSERT_TRUE(Apply(kB, again).ok());
  EXPECT_EQ(U(kB).device_bytes, 40);
  EXPECT_EQ(U(kA).device_bytes, 200);
}

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

// --- RemoveSession -----------------------------------------------------------

TEST_F(GpuPolicyTest, RemoveSessionFreesAllOfItsBytes) {
  Make(10000);
  AddSession(kA, 5000);
  AddSession(kB, 5000);
  Fill(kB, 1, 2, 100);
  v1::EventBatch batch;
  AddCreated(batch, 1, 100);
  AddCreated(batch, 2, 200, Cost::kCheap, {1});
  AddCreated(batch, 3, 300, Cost::kCheap, {2});
  AddCreated(batch, 4, 400);
  AddCreated(batch, 5, 500);
  AddEvent(batch, kFreed, 1);      // kept for 2
  AddEvent(batch, kEvicted, 2);    // needs 1 to be rebuilt
  AddEvent(batch, kOffloaded, 4);  // on the host
  ASSERT_TRUE(Apply(kA, batch).ok());
  auto orders = MakeRoom(kA, 9001);  // the GPU lacks 1 byte
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kA));
  const std::string b_before = UsageString(U(kB));
  ASSERT_TRUE(policy_->RemoveSession(kA).ok());
  EXPECT_EQ(policy_->device_bytes(), 200);
  EXPECT_EQ(UsageString(U(kB)), b_before);
  EXPECT_TRUE(absl::IsNotFound(policy_->Usage(kA).status()));
  // The same session id starts afresh, ids and all.
  AddSession(kA, 5000);
  EXPECT_EQ(U(kA).device_bytes, 0);
  EXPECT_EQ(U(kA).host_bytes, 0);
  EXPECT_EQ(U(kA).tensors, 0);
  ASSERT_TRUE(Apply(kA, batch).ok());
}

// --- Randomized --------------------------------------------------------------

// Three sessions send random batches (mostly valid, some with an error at
// the end), ask for room and get plans, and carry out what they are told.
// A model of each session's tensors, kept from what the policy accepted,
// must match its Usage; orders must name tensors of the session they are
// keyed by (sizes tell the sessions apart: bytes % 3 == session - 1).
TEST(GpuPolicyRandomized, ManyBatchesKeepAccountsAndIsolation) {
  enum class M {
    kIsResident,
    kIsOffloading,
    kIsOffloaded,
    kIsReloading,
    kIsEvictedFromDevice,
    kIsEvicted,
  };
  struct MT {
    int64_t bytes;
    bool uncomputable;
    M state;
  };
  constexpr int kSessions = 3;
  constexpr int64_t kBudget = 1500;
  constexpr uint64_t kIds = 24;

  auto made = GpuPolicy::Create(0, kSessions * kBudget, Options());
  ASSERT_TRUE(made.ok()) << made.status();
  GpuPolicy& policy = **made;
  std::vector<std::map<uint64_t, MT>> model(kSessions + 1);
  for (SessionId s = 1; s <= kSessions; ++s) {
    ASSERT_TRUE(policy.AddSession(s, kBudget, 1500).ok());
  }
  std::mt19937_64 rng(12345);
  auto pick = [&](uint64_t n) { return rng() % n; };
  auto chance = [&](int percent) { return pick(100) < uint64_t(percent); };
  int64_t now = 0;
  int failed_batches = 0;
  int rooms = 0;
  int releases = 0;
  int prefetches = 0;

  auto usages = [&] {
    std::string out;
    for (SessionId s = 1; s <= kSessions; ++s) {
      auto u = policy.Usage(s);
      absl::StrAppend(&out, s, ": ", u.ok() ? UsageString(*u) : "none", "\n");
    }
    return out;
  };
  auto check = [&](int round) {
    int64_t sum = 0;
    for (SessionId s = 1; s <= kSessions; ++s) {
      auto u = policy.Usage(s);
      ASSERT_TRUE(u.ok()) << u.status();
      int64_t device = 0, host = 0;
      for (const auto& [id, t] : model[s]) {
        if (t.state == M::kIsResident || t.state == M::kIsReloading) {
          device += t.bytes;
        }
        if (t.state == M::kIsOffloading || t.state == M::kIsOffloaded ||
            t.state == M::kIsReloading) {
          host += t.bytes;
        }
      }
      EXPECT_EQ(u->device_bytes, device)
          << "session " << s << " round " << round;
      EXPECT_EQ(u->host_bytes, host) << "session " << s << " round " << round;
      EXPECT_EQ(u->tensors, static_cast<int64_t>(model[s].size()))
          << "session " << s << " round " << round;
      sum += u->device_bytes;
    }
    ASSERT_EQ(sum, policy.device_bytes()) << "round " << round;
  };
  // An order for `owner`: its own tensor, resident, with its size.
  auto take = [&](SessionId owner, const v1::ReleaseOrder& o) {
    auto it = model[owner].find(o.tensor_id());
    ASSERT_NE(it, model[owner].end())
        << "order for session " << owner << " names unknown tensor "
        << o.tensor_id();
    ASSERT_EQ(it->second.bytes, o.bytes()) << "another session's tensor";
    ASSERT_EQ(static_cast<SessionId>(o.bytes() % 3) + 1, owner);
    ASSERT_EQ(it->second.state, M::kIsResident);
    it->second.state = o.action() == v1::ReleaseOrder::OFFLOAD
                           ? M::kIsOffloading
                           : M::kIsEvictedFromDevice;
    ++releases;
  };

  for (int round = 0; round < 4000; ++round) {
    const SessionId s = 1 + pick(kSessions);
    std::map<uint64_t, MT> next = model[s];
    v1::EventBatch batch;
    // Creations: free ids only, parents among the session's tensors.
    std::vector<uint64_t> created;
    for (uint64_t n = pick(4); n > 0; --n) {
      const uint64_t id = 1 + pick(kIds);
      if (next.contains(id)) continue;
      std::vector<uint64_t> parents;
      for (const auto& [pid, t] : next) {
        if (chance(10)) parents.push_back(pid);
      }
      Flags flags;
      flags.uncomputable = chance(20);
      const int64_t bytes =
          3 * static_cast<int64_t>(10 + pick(60)) + static_cast<int64_t>(s - 1);
      AddCreated(batch, id, bytes, chance(50) ? Cost::kCheap : Cost::kCostly,
                 parents, flags);
      next[id] = MT{bytes, flags.uncomputable, M::kIsResident};
      created.push_back(id);
    }
    // Events the state allows, as a well-behaved process would send them.
    for (uint64_t n = pick(5); n > 0 && !next.empty(); --n) {
      auto it = next.begin();
      std::advance(it, static_cast<long>(pick(next.size())));
      MT& t = it->second;
      std::vector<std::pair<Kind, M>> moves;  // kind, state after
      switch (t.state) {
        case M::kIsResident:
          moves = {{kAccessed, M::kIsResident}, {kOffloaded, M::kIsOffloaded}};
          if (!t.uncomputable) moves.push_back({kEvicted, M::kIsEvicted});
          break;
        case M::kIsOffloading:
          moves = {{kAccessed, M::kIsOffloading},
                   {kOffloaded, M::kIsOffloaded},
                   {kReleaseFailed, M::kIsResident}};
          break;
        case M::kIsOffloaded:
          moves = {{kReloaded, M::kIsResident}};
          if (!t.uncomputable) {
            moves.push_back({kRecomputed, M::kIsResident});
            moves.push_back({kEvicted, M::kIsEvicted});
          }
          break;
        case M::kIsReloading:
          moves = {{kReloaded, M::kIsResident},
                   {kAccessed, M::kIsReloading},
                   {kReleaseFailed, M::kIsOffloaded},
                   {kOffloaded, M::kIsOffloaded}};
          break;
        case M::kIsEvictedFromDevice:
          moves = {{kEvicted, M::kIsEvictedFromDevice},
                   {kReleaseFailed, M::kIsResident},
                   {kRecomputed, M::kIsResident}};
          break;
        case M::kIsEvicted:
          moves = {{kRecomputed, M::kIsResident}};
          break;
      }
      if (chance(15)) {
        AddEvent(batch, kFreed, it->first);
        next.erase(it);
        continue;
      }
      const auto& [kind, after] = moves[pick(moves.size())];
      AddEvent(batch, kind, it->first);
      // Evicting an offloaded tensor drops its host copy: not cancellable.
      t.state = after;
    }
    // Sometimes a bad entry at the end: the whole batch must fail.
    const bool bad = chance(10);
    if (bad) {
      switch (pick(3)) {
        case 0:
          AddEvent(batch, kAccessed, kIds + 1 + pick(5));  // unknown id
          break;
        case 1:
          AddEvent(batch, v1::TensorEvent::KIND_UNSPECIFIED, 1);
          break;
        default:
          if (!next.empty()) {
            // Recomputing a resident tensor (or a freed one) is refused.
            bool found = false;
            for (const auto& [id, t] : next) {
              if (t.state == M::kIsResident) {
                AddEvent(batch, kRecomputed, id);
                found = true;
                break;
              }
            }
            if (!found) AddEvent(batch, kAccessed, kIds + 1);
          } else {
            AddEvent(batch, kAccessed, kIds + 1);
          }
      }
    }
    const std::string before = usages();
    const absl::Status applied = policy.Apply(s, batch, now += 10);
    if (bad) {
      ASSERT_FALSE(applied.ok()) << "round " << round;
      ASSERT_EQ(usages(), before) << "round " << round << ": " << applied;
      ++failed_batches;
    } else {
      ASSERT_TRUE(applied.ok()) << "round " << round << ": " << applied;
      model[s] = std::move(next);
    }
    check(round);

    if (chance(30)) {
      const SessionId r = 1 + pick(kSessions);
      std::vector<SessionUsage> was(kSessions + 1);
      for (SessionId x = 1; x <= kSessions; ++x) was[x] = *policy.Usage(x);
      const std::string room_before = usages();
      auto orders =
          policy.MakeRoom(r, static_cast<int64_t>(pick(2500)), now += 10);
      if (orders.ok()) {
        ++rooms;
        for (const auto& [owner, list] : *orders) {
          // Only sessions above their share, or the one asking, lose.
          if (owner != r) {
            EXPECT_GT(was[owner].device_bytes, was[owner].budget_bytes)
                << "round " << round;
          }
          for (const v1::ReleaseOrder& o : list) take(owner, o);
        }
      } else {
        ASSERT_TRUE(absl::IsResourceExhausted(orders.status()))
            << orders.status();
        ASSERT_EQ(usages(), room_before) << "round " << round;
      }
      check(round);
    }

    std::vector<SessionUsage> was(kSessions + 1);
    for (SessionId x = 1; x <= kSessions; ++x) was[x] = *policy.Usage(x);
    for (const auto& [owner, orders] : policy.Plan(s, now += 10)) {
      if (owner != s) {
        EXPECT_GT(was[owner].device_bytes, was[owner].budget_bytes)
            << "round " << round;
        EXPECT_EQ(orders.prefetch_tensor_ids_size(), 0);
      }
      for (const v1::ReleaseOrder& o : orders.release()) take(owner, o);
      for (uint64_t id : orders.prefetch_tensor_ids()) {
        auto it = model[owner].find(id);
        ASSERT_NE(it, model[owner].end());
        ASSERT_EQ(it->second.state, M::kIsOffloaded);
        it->second.state = M::kIsReloading;
        ++prefetches;
      }
    }
    check(round);

    if (chance(2)) {  // budgets move as sessions come and go
      ASSERT_TRUE(policy
                      .SetBudget(1 + pick(kSessions),
                                 static_cast<int64_t>(500 + pick(4000)))
                      .ok());
    }
    if (chance(1)) {  // a process ends and another takes its place
      const SessionId x = 1 + pick(kSessions);
      ASSERT_TRUE(policy.RemoveSession(x).ok());
      model[x].clear();
      ASSERT_TRUE(policy.AddSession(x, kBudget, 1500).ok());
      check(round);
    }
    if (::testing::Test::HasFatalFailure() || ::testing::Test::HasFailure()) {
      FAIL() << "stopped at round " << round;
    }
  }
  std::cout << "failed batches " << failed_batches << ", rooms made " << rooms
            << ", releases " << releases << ", prefetches " << prefetches
            << "\n";
  // The run must have exercised what it claims to.
  EXPECT_GT(failed_batches, 100);
  EXPECT_GT(rooms, 100);
  EXPECT_GT(releases, 100);
  EXPECT_GT(prefetches, 20);
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

// Regression: orders for a session without a stream were dropped by the
// service while the policy already counted their tensors as released; the
// process never heard of them and every later event on them was refused.
TEST_F(GpuPolicyTest, UndeliverableOrdersAreUndone) {
  Make(1000);
  AddSession(1, 500);
  AddSession(2, 500);
  v1::EventBatch b;
  AddCreated(b, 1, 500);
  AddCreated(b, 2, 10);
  ASSERT_TRUE(Apply(2, b).ok());
  v1::EventBatch a;
  AddCreated(a, 1, 490);
  ASSERT_TRUE(Apply(1, a).ok());
  auto orders = policy_->MakeRoom(1, 10, now_);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_TRUE(orders->contains(2));
  EXPECT_EQ(policy_->Usage(2)->device_bytes, 500);
  v1::Orders lost;
  for (const v1::ReleaseOrder& o : orders->at(2)) *lost.add_release() = o;
  policy_->Undeliverable(2, lost);
  EXPECT_EQ(policy_->Usage(2)->device_bytes, 510);
  // The tensor is the session's again: an access is accepted.
  v1::EventBatch touch;
  AddEvent(touch, v1::TensorEvent::ACCESSED, 2);
  EXPECT_TRUE(Apply(2, touch).ok());
}

TEST_F(GpuPolicyTest, ASessionWithoutAStreamIsNeverAVictimOfAnother) {
  Make(1000);
  AddSession(1, 500);
  AddSession(2, 500);
  v1::EventBatch b;
  AddCreated(b, 1, 510);
  ASSERT_TRUE(Apply(2, b).ok());                      // over its share, but
  ASSERT_TRUE(policy_->SetReachable(2, false).ok());  // its stream is gone
  v1::EventBatch a;
  AddCreated(a, 1, 490);
  ASSERT_TRUE(Apply(1, a).ok());
  // Within its share, 1 answers for none of 2's excess.
  auto orders = policy_->MakeRoom(1, 10, now_);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(*orders, IsEmpty());
  // Past it, the requester pays itself.
  orders = policy_->MakeRoom(1, 20, now_);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_FALSE(orders->contains(2));
  EXPECT_TRUE(orders->contains(1));
  EXPECT_EQ(policy_->SetReachable(9, true).code(), absl::StatusCode::kNotFound);
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
