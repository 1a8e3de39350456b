// Tests of the Prefetcher (DELTA Algorithm 4) and of the replay plan it can
// follow (AccessPlan: the previous iteration's access order, out-of-core
// paper §3).

#include "policies/prefetcher.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/access_plan.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr SessionId kSession = 1;
constexpr int64_t kLots = int64_t{1} << 40;

PrefetchOptions Options(int max_in_flight, int64_t window_bytes = 0) {
  PrefetchOptions o;
  o.max_in_flight = max_in_flight;
  o.window_bytes = window_bytes;
  return o;
}

TensorSpec Spec(TensorId id, int64_t bytes, uint64_t key = 0,
                SessionId session = kSession,
                std::vector<TensorId> parents = {}) {
  TensorSpec s;
  s.id = id;
  s.session = session;
  s.gpu = 0;
  s.bytes = bytes;
  s.compute_cost_ns = 10;
  s.stable_key = key;
  s.parents = std::move(parents);
  return s;
}

int64_t SumBytes(const TensorTable& table, const std::vector<TensorId>& ids) {
  int64_t sum = 0;
  for (TensorId id : ids) sum += table.Find(id)->bytes;
  return sum;
}

class PrefetcherTest : public ::testing::Test {
 protected:
  // A fresh prefetcher with these options replaces the fixture's.
  void Make(PrefetchOptions options) {
    absl::StatusOr<Prefetcher> p = Prefetcher::Create(options);
    ASSERT_TRUE(p.ok()) << p.status();
    prefetcher_.emplace(*std::move(p));
  }
  void Add(const TensorSpec& spec) {
    const absl::Status s = table_.Add(spec, 0);
    ASSERT_TRUE(s.ok()) << s;
  }
  // Offload completes and the tensor joins the prefetch queue.
  void Offload(TensorId id) {
    absl::Status s = table_.SetState(id, TensorState::kOffloading);
    ASSERT_TRUE(s.ok()) << s;
    s = table_.SetState(id, TensorState::kOffloaded);
    ASSERT_TRUE(s.ok()) << s;
    prefetcher_->OnOffloaded(id);
  }
  std::vector<TensorId> Plan(int64_t free_bytes, int in_flight,
                             const AccessPlan* plan = nullptr,
                             SessionId session = kSession) {
    return prefetcher_->Plan(table_, free_bytes, in_flight, plan, session);
  }

  TensorTable table_;
  std::optional<Prefetcher> prefetcher_;
};

TEST(PrefetcherCreateTest, RejectsFewerThanOneInFlight) {
  for (int n : {0, -1}) {
    absl::StatusOr<Prefetcher> p = Prefetcher::Create(Options(n));
    ASSERT_FALSE(p.ok()) << n;
    EXPECT_TRUE(absl::IsInvalidArgument(p.status())) << p.status();
    EXPECT_THAT(std::string(p.status().message()),
                HasSubstr(std::to_string(n)));
  }
}

TEST(PrefetcherCreateTest, RejectsANegativeWindow) {
  absl::StatusOr<Prefetcher> p = Prefetcher::Create(Options(2, -1));
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(p.status())) << p.status();
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("window"));
}

TEST(PrefetcherCreateTest, AcceptsOneInFlightAndNoWindow) {
  EXPECT_TRUE(Prefetcher::Create(Options(1, 0)).ok());
  EXPECT_TRUE(Prefetcher::Create(Options(1, 4096)).ok());
}

TEST_F(PrefetcherTest, ReloadsNewestOffloadedFirst) {
  Make(Options(10));
  for (TensorId id = 1; id <= 4; ++id) Add(Spec(id, 100));
  for (TensorId id : {2, 1, 4, 3}) Offload(id);
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(3, 4, 1, 2));
  EXPECT_EQ(prefetcher_->queued(), 0u);
  EXPECT_THAT(Plan(kLots, 0), IsEmpty());
}

TEST_F(PrefetcherTest, NeverMoreThanMaxInFlightMinusInFlight) {
  Make(Options(3));
  for (TensorId id = 1; id <= 10; ++id) {
    Add(Spec(id, 100));
    Offload(id);
  }
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(10, 9, 8));
  EXPECT_THAT(Plan(kLots, 1), ElementsAre(7, 6));
  EXPECT_THAT(Plan(kLots, 2), ElementsAre(5));
  EXPECT_THAT(Plan(kLots, 3), IsEmpty());
  EXPECT_THAT(Plan(kLots, 7), IsEmpty());
  // What was not planned stays queued, in order.
  EXPECT_EQ(prefetcher_->queued(), 4u);
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(4, 3, 2));
}

TEST_F(PrefetcherTest, NeverMoreBytesThanFree) {
  Make(Options(100));
  // Newest first: 6 (10), 5 (400), 4 (100), 3 (200), 2 (50), 1 (300).
  const int64_t sizes[] = {300, 50, 200, 100, 400, 10};
  for (TensorId id = 1; id <= 6; ++id) {
    Add(Spec(id, sizes[id - 1]));
    Offload(id);
  }
  for (int64_t free_bytes = 0; free_bytes <= 1200; free_bytes += 7) {
    Make(Options(100));
    for (TensorId id = 1; id <= 6; ++id) prefetcher_->OnOffloaded(id);
    const std::vector<TensorId> out = Plan(free_bytes, 0);
    EXPECT_LE(SumBytes(table_, out), free_bytes) << free_bytes;
    // And memory that is there is used: the newest tensor fits in 10.
    EXPECT_EQ(out.empty(), free_bytes < 10) << free_bytes;
  }
}

TEST_F(PrefetcherTest, StopsAtTheFirstTensorThatDoesNotFit) {
  Make(Options(10));
  Add(Spec(1, 100));
  Add(Spec(2, 500));
  Add(Spec(3, 200));
  for (TensorId id : {1, 2, 3}) Offload(id);
  // 3 fits (200 of 450); 2 does not (500 > 250): 1 is not taken out of
  // turn, the order of use is kept.
  EXPECT_THAT(Plan(450, 0), ElementsAre(3));
  EXPECT_THAT(Plan(499, 0), IsEmpty());
  EXPECT_THAT(Plan(600, 0), ElementsAre(2, 1));
  EXPECT_THAT(Plan(0, 0), IsEmpty());
}

TEST_F(PrefetcherTest, DropsEntriesThatAreNoLongerOffloaded) {
  Make(Options(10));
  for (TensorId id = 1; id <= 7; ++id) Add(Spec(id, 100));
  Add(Spec(8, 100, 0, kSession, {6}));  // a live child keeps 6 recorded
  for (TensorId id = 1; id <= 7; ++id) Offload(id);
  // 7: reloaded on demand; 6: freed but kept for its child (kFreed);
  // 5: recomputed; 4: freed and gone; 3: reload in flight; 2: host copy
  // dropped (evicted). Only 1 is still offloaded.
  ASSERT_TRUE(table_.SetState(7, TensorState::kResident).ok());
  ASSERT_TRUE(table_.Free(6).ok());
  ASSERT_EQ(table_.Find(6)->state, TensorState::kFreed);
  ASSERT_TRUE(table_.MarkRecomputed(5, 0).ok());
  ASSERT_TRUE(table_.Free(4).ok());
  ASSERT_EQ(table_.Find(4), nullptr);
  ASSERT_TRUE(table_.SetState(3, TensorState::kReloading).ok());
  ASSERT_TRUE(table_.SetState(2, TensorState::kEvicted).ok());
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(1));
  EXPECT_EQ(prefetcher_->queued(), 0u);
}

TEST_F(PrefetcherTest, StaleEntriesDoNotTakeInFlightSlots) {
  Make(Options(2));
  for (TensorId id = 1; id <= 5; ++id) {
    Add(Spec(id, 100));
    Offload(id);
  }
  ASSERT_TRUE(table_.SetState(5, TensorState::kResident).ok());
  ASSERT_TRUE(table_.SetState(4, TensorState::kResident).ok());
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(3, 2));
  EXPECT_EQ(prefetcher_->queued(), 1u);
}

TEST_F(PrefetcherTest, ATensorOffloadedTwiceIsReloadedOnce) {
  Make(Options(10));
  Add(Spec(1, 100));
  Add(Spec(2, 100));
  Offload(1);
  Offload(2);
  ASSERT_TRUE(table_.SetState(1, TensorState::kResident).ok());  // reloaded
  Offload(1);  // and offloaded again: now the newest
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(1, 2));
  EXPECT_EQ(prefetcher_->queued(), 0u);
}

// --- Replay plan ---------------------------------------------------------

// Iteration 1 used keys 101..106 (100 bytes each) in that order; iteration 2
// has new tensors 11..16 with the same keys, of which 13..16 are offloaded
// (14, 15, 16 newest first in the queue would give the reverse order).
class PrefetcherReplayTest : public PrefetcherTest {
 protected:
  void SetUp() override {
    for (TensorId id = 1; id <= 6; ++id) {
      Add(Spec(id, 100, 100 + id));
      plan_.Record(100 + id, 100);
    }
    plan_.EndIteration();
    for (TensorId id = 1; id <= 6; ++id) ASSERT_TRUE(table_.Free(id).ok());
    for (TensorId id = 11; id <= 16; ++id) Add(Spec(id, 100, 90 + id));
    Make(Options(10, /*window_bytes=*/250));
    for (TensorId id = 13; id <= 16; ++id) Offload(id);
    // Iteration 2 has used 101 and 102 so far.
    plan_.Record(101, 100);
    plan_.Record(102, 100);
  }
  AccessPlan plan_;
};

TEST_F(PrefetcherReplayTest, FollowsThePreviousIterationsOrderWithinTheWindow) {
  ASSERT_EQ(plan_.cursor(), 2u);
  // The window of 250 bytes covers keys 103 and 104 (105 would make 300).
  EXPECT_THAT(Plan(kLots, 0, &plan_), ElementsAre(13, 14));
  // Without a plan, the queue's newest-first order applies.
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(16, 15, 14, 13));
}

TEST_F(PrefetcherReplayTest, WindowMovesWithTheCursor) {
  plan_.Record(103, 100);
  ASSERT_TRUE(table_.SetState(13, TensorState::kResident).ok());  // used it
  EXPECT_THAT(Plan(kLots, 0, &plan_), ElementsAre(14, 15));
  plan_.Record(104, 100);
  plan_.Record(105, 100);
  EXPECT_THAT(Plan(kLots, 0, &plan_), ElementsAre(16));
  plan_.Record(106, 100);
  EXPECT_THAT(Plan(kLots, 0, &plan_), IsEmpty());  // end of the plan
}

TEST_F(PrefetcherReplayTest, ResidentTensorsInTheWindowAreSkippedButCount) {
  ASSERT_TRUE(table_.SetState(13, TensorState::kResident).ok());
  // 103 is resident and still takes 100 bytes of the window.
  EXPECT_THAT(Plan(kLots, 0, &plan_), ElementsAre(14));
}

TEST_F(PrefetcherReplayTest, RespectsInFlightAndFreeBytes) {
  EXPECT_THAT(Plan(kLots, 9, &plan_), ElementsAre(13));
  EXPECT_THAT(Plan(kLots, 10, &plan_), IsEmpty());
  EXPECT_THAT(Plan(199, 0, &plan_), ElementsAre(13));
  EXPECT_THAT(Plan(99, 0, &plan_), IsEmpty());
  EXPECT_THAT(Plan(0, 0, &plan_), IsEmpty());
}

TEST_F(PrefetcherReplayTest, OnlyTheGivenSessionsTensorsAreReloaded) {
  // Session 2 has offloaded tensors with the same keys.
  for (TensorId id = 23; id <= 24; ++id) {
    Add(Spec(id, 100, 80 + id, /*session=*/2));
    Offload(id);
  }
  EXPECT_THAT(Plan(kLots, 0, &plan_, /*session=*/2), ElementsAre(23, 24));
  EXPECT_THAT(Plan(kLots, 0, &plan_, kSession), ElementsAre(13, 14));
}

TEST_F(PrefetcherReplayTest, ZeroWindowOrNoPlanUsesTheQueue) {
  Make(Options(10, /*window_bytes=*/0));
  for (TensorId id = 13; id <= 16; ++id) prefetcher_->OnOffloaded(id);
  EXPECT_THAT(Plan(kLots, 0, &plan_), ElementsAre(16, 15, 14, 13));

  Make(Options(10, /*window_bytes=*/250));
  for (TensorId id = 13; id <= 16; ++id) prefetcher_->OnOffloaded(id);
  AccessPlan empty;  // first iteration: nothing to replay yet
  EXPECT_THAT(Plan(kLots, 0, &empty), ElementsAre(16, 15, 14, 13));
}

TEST_F(PrefetcherReplayTest, QueueStaysBoundedWhileThePlanIsFollowed) {
  // Many iterations of: prefetch by the plan, reload, offload again. The
  // queue (the fallback when there is no plan) must not keep every offload
  // ever seen.
  for (int iteration = 0; iteration < 200; ++iteration) {
    for (uint64_t key = 103; key <= 106; ++key) plan_.Record(key, 100);
    plan_.EndIteration();
    plan_.Record(101, 100);
    plan_.Record(102, 100);
    const std::vector<TensorId> planned = Plan(kLots, 0, &plan_);
    ASSERT_THAT(planned, ElementsAre(13, 14));
    // Stale entries go once the queue doubles: never more than 64 here
    // (4 tensors offloaded at most at once).
    ASSERT_LE(prefetcher_->queued(), 64u) << "iteration " << iteration;
    for (TensorId id : planned) {
      ASSERT_TRUE(table_.SetState(id, TensorState::kReloading).ok());
      ASSERT_TRUE(table_.SetState(id, TensorState::kResident).ok());
    }
    for (TensorId id = 13; id <= 16; ++id) {
      if (table_.Find(id)->state == TensorState::kResident) Offload(id);
    }
  }
  // The queue still serves newest-offloaded first when the plan is gone.
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(14, 13, 16, 15));
}

TEST_F(PrefetcherTest, RepeatedKeysInThePlanAreReloadedOnce) {
  Make(Options(10, /*window_bytes=*/1000));
  Add(Spec(1, 100, 7));
  Add(Spec(2, 100, 8));
  AccessPlan plan;
  for (uint64_t key : {7, 8, 7, 8}) plan.Record(key, 100);
  plan.EndIteration();
  Offload(1);
  Offload(2);
  EXPECT_THAT(Plan(kLots, 0, &plan), ElementsAre(1, 2));
}

TEST(AccessPlanRecordingTest, NothingToReplayBeforeTheFirstIterationEnds) {
  AccessPlan plan;
  EXPECT_FALSE(plan.has_plan());
  plan.Record(1, 10);
  plan.Record(2, 10);
  EXPECT_FALSE(plan.has_plan());
  EXPECT_EQ(plan.cursor(), 0u);
  EXPECT_THAT(plan.LookAhead(1000), IsEmpty());
  plan.EndIteration();
  EXPECT_TRUE(plan.has_plan());
  EXPECT_EQ(plan.plan_size(), 2u);
}

std::vector<uint64_t> Keys(const std::vector<AccessPlan::Entry>& entries) {
  std::vector<uint64_t> keys;
  for (const AccessPlan::Entry& e : entries) keys.push_back(e.key);
  return keys;
}

// Plan: A(10) B(20) C(30) D(40).
class AccessPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    plan_.Record(kA, 10);
    plan_.Record(kB, 20);
    plan_.Record(kC, 30);
    plan_.Record(kD, 40);
    plan_.EndIteration();
  }
  static constexpr uint64_t kA = 1, kB = 2, kC = 3, kD = 4;
  AccessPlan plan_;
};

TEST_F(AccessPlanTest, LookAheadStaysWithinTheWindow) {
  EXPECT_EQ(plan_.cursor(), 0u);
  EXPECT_THAT(Keys(plan_.LookAhead(60)), ElementsAre(kA, kB, kC));
  EXPECT_THAT(Keys(plan_.LookAhead(59)), ElementsAre(kA, kB));
  EXPECT_THAT(Keys(plan_.LookAhead(100)), ElementsAre(kA, kB, kC, kD));
  const std::vector<AccessPlan::Entry> ahead = plan_.LookAhead(30);
  ASSERT_EQ(ahead.size(), 2u);
  EXPECT_EQ(ahead[1].bytes, 20);
}

TEST_F(AccessPlanTest, LookAheadAlwaysIncludesTheNextAccess) {
  EXPECT_THAT(Keys(plan_.LookAhead(0)), ElementsAre(kA));
  EXPECT_THAT(Keys(plan_.LookAhead(5)), ElementsAre(kA));
}

TEST_F(AccessPlanTest, RecordMovesTheCursorPastTheKey) {
  plan_.Record(kA, 10);
  EXPECT_EQ(plan_.cursor(), 1u);
  EXPECT_THAT(Keys(plan_.LookAhead(50)), ElementsAre(kB, kC));
  plan_.Record(kC, 30);  // B was skipped this time
  EXPECT_EQ(plan_.cursor(), 3u);
  EXPECT_THAT(Keys(plan_.LookAhead(0)), ElementsAre(kD));
  plan_.Record(kB, 20);  // B is behind the cursor: it stays
  EXPECT_EQ(plan_.cursor(), 3u);
  plan_.Record(99, 5);  // not in the plan: it stays
  EXPECT_EQ(plan_.cursor(), 3u);
  plan_.Record(kD, 40);
  EXPECT_EQ(plan_.cursor(), 4u);
  EXPECT_THAT(plan_.LookAhead(1000), IsEmpty());
}

TEST_F(AccessPlanTest, RecordingDoesNotChangeThePlanUntilTheIterationEnds) {
  plan_.Record(kD, 40);
  plan_.Record(kC, 30);
  EXPECT_EQ(plan_.plan_size(), 4u);
  EXPECT_THAT(plan_.LookAhead(1000), IsEmpty());  // D was last
  plan_.EndIteration();
  EXPECT_EQ(plan_.cursor(), 0u);
  EXPECT_EQ(plan_.plan_size(), 2u);
  EXPECT_THAT(Keys(plan_.LookAhead(1000)), ElementsAre(kD, kC));
}

TEST_F(AccessPlanTest,
       AccessesUntilNextCountFromTheCursorAndWrapToTheNextIteration) {
  EXPECT_EQ(plan_.AccessesUntilNext(kA), 1);
  EXPECT_EQ(plan_.AccessesUntilNext(kD), 4);
  EXPECT_EQ(plan_.AccessesUntilNext(99), -1);  // not in the plan
  plan_.Record(kA, 10);
  plan_.Record(kB, 20);
  EXPECT_EQ(plan_.AccessesUntilNext(kC), 1);
  EXPECT_EQ(plan_.AccessesUntilNext(kD), 2);
  // A's use in this iteration is past: the next one is the next
  // iteration's first access, after C and D.
  EXPECT_EQ(plan_.AccessesUntilNext(kA), 3);
  EXPECT_EQ(plan_.AccessesUntilNext(kB), 4);
}

TEST(AccessPlanRepeatTest, AccessesUntilNextFindTheNextOfSeveralUses) {
  AccessPlan plan;
  for (uint64_t key : {1, 2, 1, 3}) plan.Record(key, 10);
  plan.EndIteration();
  EXPECT_EQ(plan.AccessesUntilNext(1), 1);
  plan.Record(1, 10);
  EXPECT_EQ(plan.AccessesUntilNext(1), 2);  // its second use
  plan.Record(2, 10);
  plan.Record(1, 10);
  EXPECT_EQ(plan.AccessesUntilNext(1), 2);  // after 3, the next iteration
  EXPECT_EQ(plan.AccessesUntilNext(3), 1);
}

TEST(AccessPlanRepeatTest, RepeatedKeysAdvanceToTheNextOccurrence) {
  // A B A C: a tensor used in forward and again in backward.
  AccessPlan plan;
  for (uint64_t key : {1, 2, 1, 3}) plan.Record(key, 10);
  plan.EndIteration();
  plan.Record(1, 10);
  EXPECT_EQ(plan.cursor(), 1u);
  EXPECT_THAT(Keys(plan.LookAhead(1000)), ElementsAre(2, 1, 3));
  plan.Record(1, 10);  // the second use of A: B was skipped
  EXPECT_EQ(plan.cursor(), 3u);
  EXPECT_THAT(Keys(plan.LookAhead(1000)), ElementsAre(3));
  plan.Record(2, 10);  // B's only occurrence is behind
  EXPECT_EQ(plan.cursor(), 3u);
}

TEST(AccessPlanRepeatTest, InOrderRepeatVisitsEveryOccurrence) {
  AccessPlan plan;
  for (uint64_t key : {1, 2, 1, 2}) plan.Record(key, 10);
  plan.EndIteration();
  std::vector<size_t> cursors;
  for (uint64_t key : {1, 2, 1, 2}) {
    plan.Record(key, 10);
    cursors.push_back(plan.cursor());
  }
  EXPECT_THAT(cursors, ElementsAre(1, 2, 3, 4));
  // The iteration just recorded becomes the next plan, followed from its
  // start again: where the last searches stopped is forgotten.
  plan.EndIteration();
  EXPECT_EQ(plan.plan_size(), 4u);
  EXPECT_EQ(plan.cursor(), 0u);
  cursors.clear();
  for (uint64_t key : {1, 2, 1, 2}) {
    plan.Record(key, 10);
    cursors.push_back(plan.cursor());
  }
  EXPECT_THAT(cursors, ElementsAre(1, 2, 3, 4));
}

// Regression: Plan returned before dropping stale entries whenever no reload
// slot was free, so a caller stuck at its in-flight limit grew the queue
// with every offload, without bound.
TEST_F(PrefetcherTest, QueueStaysBoundedWhenNoReloadSlotIsFree) {
  Make(Options(1, 0));
  Add(Spec(1, 100, 1));
  for (int round = 0; round < 1000; ++round) {
    Offload(1);
    EXPECT_TRUE(Plan(kLots, /*in_flight=*/1).empty());
    ASSERT_TRUE(table_.SetState(1, TensorState::kReloading).ok());
    ASSERT_TRUE(table_.SetState(1, TensorState::kResident).ok());
    // Stale entries go once the queue has doubled since they last did.
    ASSERT_LE(prefetcher_->queued(), 64u) << "round " << round;
  }
  prefetcher_->DropStale(table_);
  EXPECT_EQ(prefetcher_->queued(), 0u);
}

TEST_F(PrefetcherTest, StaleEntriesAreSkippedBeforeTheyAreDropped) {
  Make(Options(4, 0));
  for (TensorId id = 1; id <= 3; ++id) Add(Spec(id, 100, id));
  for (TensorId id = 1; id <= 3; ++id) Offload(id);
  // 3 reloaded on demand and 2 offloaded again: the queue, still holding
  // their old entries, gives each offloaded tensor once, newest first.
  ASSERT_TRUE(table_.SetState(3, TensorState::kReloading).ok());
  ASSERT_TRUE(table_.SetState(3, TensorState::kResident).ok());
  ASSERT_TRUE(table_.SetState(2, TensorState::kReloading).ok());
  ASSERT_TRUE(table_.SetState(2, TensorState::kResident).ok());
  Offload(2);
  EXPECT_EQ(prefetcher_->queued(), 4u);  // not compacted yet
  EXPECT_THAT(Plan(kLots, 0), ElementsAre(2, 1));
}

}  // namespace
}  // namespace deltad::policy
