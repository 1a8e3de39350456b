#include <optional>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/resident_bytes.h"
#include "tests/unit/policies/status_assertions.h"
#include "tests/unit/policies/tensor_table_test_helpers.h"

namespace deltad::policy {
namespace {

using testing_util::ResidentBytes;

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testing_util::GpuScope;
using testing_util::Ids;
using testing_util::IsError;
using testing_util::IsOk;
using testing_util::Reach;
using testing_util::Spec;
using testing_util::StateOf;
using testing_util::StatsAre;
using S = TensorState;

// --- Freeing and retirement
// -----------------------------------------------------

TEST(TensorTable, FreeFromEveryStateReleasesItsBytes) {
  for (S from : {S::kResident, S::kOffloading, S::kOffloaded, S::kReloading,
                 S::kEvicted}) {
    SCOPED_TRACE(TensorStateName(from));
    TensorTable table;
    ASSERT_TRUE(IsOk(table.Add(Spec(1, 100, {}, 3, 1), 0)));
    ASSERT_TRUE(IsOk(table.Add(Spec(2, 7, {}, 3, 1), 0)));
    Reach(table, 1, from);
    ASSERT_TRUE(IsOk(table.Free(1)));
    EXPECT_EQ(table.Find(1), nullptr);  // no child: retired at once
    EXPECT_FALSE(table.Contains(1));
    EXPECT_EQ(table.size(), 1u);
    EXPECT_TRUE(StatsAre(table.GpuStats(1), {.device = 7, .tensors = 1}));
    EXPECT_TRUE(StatsAre(table.SessionStats(3), {.device = 7, .tensors = 1}));
    EXPECT_THAT(Ids(table, table.Candidates(GpuScope(1))), ElementsAre(2));
    EXPECT_EQ(table.CandidateBytes(GpuScope(1)), 7);
    EXPECT_EQ(table.components().size(), 0u);
  }
}

TEST(TensorTable, FreeWithLiveChildKeepsRecordButReleasesBytes) {
  for (S from : {S::kResident, S::kOffloading, S::kOffloaded, S::kReloading,
                 S::kEvicted}) {
    SCOPED_TRACE(TensorStateName(from));
    TensorTable table;
    ASSERT_TRUE(IsOk(table.Add(Spec(1, 100), 0)));
    ASSERT_TRUE(IsOk(table.Add(Spec(2, 7, {1}), 0)));
    Reach(table, 1, from);
    ASSERT_TRUE(IsOk(table.Free(1)));
    ASSERT_NE(table.Find(1), nullptr);
    EXPECT_EQ(StateOf(table, 1), S::kFreed);
    EXPECT_EQ(table.size(), 2u);
    EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 7, .tensors = 1}));
    EXPECT_THAT(Ids(table, table.Candidates(GpuScope(0))), ElementsAre(2));
    // It must be rebuilt if 2 is: a member of the evicted components.
    EXPECT_TRUE(table.components().Contains(table.SlotOf(1)));
  }
}

TEST(TensorTable, FreeTwiceIsFailedPrecondition) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 10, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Free(1)));
  EXPECT_TRUE(IsError(table.Free(1), absl::StatusCode::kFailedPrecondition,
                      {"tensor 1 was already freed"}));
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 10, .tensors = 1}));
  // Once retired the id is simply unknown.
  ASSERT_TRUE(IsOk(table.Free(2)));
  EXPECT_TRUE(IsError(table.Free(1), absl::StatusCode::kNotFound));
  EXPECT_TRUE(IsError(table.Free(2), absl::StatusCode::kNotFound));
}

TEST(TensorTable, FreedAncestorsRetireRecursivelyWithLastChild) {
  TensorTable table;
  // 1 -> 2 -> 3 -> 4, and 4 is the only one alive at the end.
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 2, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 4, {2}), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(4, 8, {3}), 0)));
  ASSERT_TRUE(IsOk(table.Free(2)));
  ASSERT_TRUE(IsOk(table.Free(1)));
  ASSERT_TRUE(IsOk(table.Free(3)));
  EXPECT_EQ(table.size(), 4u);
  for (TensorId id : {1, 2, 3}) EXPECT_EQ(StateOf(table, id), S::kFreed);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 8, .tensors = 1}));
  EXPECT_EQ(table.components().size(), 3u);

  ASSERT_TRUE(IsOk(table.Free(4)));
  for (TensorId id : {1, 2, 3, 4}) EXPECT_EQ(table.Find(id), nullptr) << id;
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.components().size(), 0u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {}));
}

TEST(TensorTable, RetirementStopsAtLiveAncestor) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 2, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 4, {2}), 0)));
  ASSERT_TRUE(IsOk(table.Free(2)));  // kept for 3
  ASSERT_TRUE(IsOk(table.Free(3)));  // 3 and then 2 retire; 1 is alive
  EXPECT_EQ(table.Find(3), nullptr);
  EXPECT_EQ(table.Find(2), nullptr);
  ASSERT_NE(table.Find(1), nullptr);
  EXPECT_EQ(StateOf(table, 1), S::kResident);
  EXPECT_THAT(table.Find(1)->children, IsEmpty());
  EXPECT_EQ(table.Find(1)->live_children, 0u);
  EXPECT_EQ(table.size(), 1u);
  ASSERT_TRUE(IsOk(table.Free(1)));
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable, DiamondParentRetiresAfterItsLastChild) {
  TensorTable table;
  // 1 -> 2, 1 -> 3, {2, 3} -> 4.
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 2, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 4, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(4, 8, {2, 3}), 0)));
  ASSERT_TRUE(IsOk(table.Free(1)));
  ASSERT_TRUE(IsOk(table.Free(2)));
  ASSERT_TRUE(IsOk(table.Free(3)));
  EXPECT_EQ(table.size(), 4u);
  ASSERT_TRUE(IsOk(table.Free(4)));
  EXPECT_EQ(table.size(), 0u);

  // Again, but the last child of 1 goes without grandchildren first.
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 2, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 4, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Free(1)));
  ASSERT_TRUE(IsOk(table.Free(2)));
  EXPECT_EQ(table.Find(2), nullptr);
  ASSERT_NE(table.Find(1), nullptr);
  EXPECT_EQ(table.Find(1)->live_children, 1u);
  ASSERT_TRUE(IsOk(table.Free(3)));
  EXPECT_EQ(table.Find(1), nullptr);
  EXPECT_EQ(table.size(), 0u);
}

// A parent's children leave its list in O(1), the last one taking the
// place of the one that goes: whatever the order, the list is exactly the
// children still there, and slots reused meanwhile link anew.
TEST(TensorTable, ChildrenRetiredInAnyOrderLeaveTheirParentsListsExact) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2), 0)));
  // Every third child of 1 only; the others of both, in either order.
  auto parents_of = [](TensorId c) {
    return c % 3 == 0 ? std::vector<TensorId>{1}
                      : (c % 2 ? std::vector<TensorId>{1, 2}
                               : std::vector<TensorId>{2, 1});
  };
  std::set<TensorId> live;
  for (TensorId c = 10; c < 60; ++c) {
    ASSERT_TRUE(IsOk(table.Add(Spec(c, 100, parents_of(c)), 0)));
    live.insert(c);
  }
  auto children_of = [&](TensorId id) {
    const std::vector<TensorId> ids = Ids(table, table.Find(id)->children);
    return std::set<TensorId>(ids.begin(), ids.end());
  };
  auto expect_exact = [&] {
    std::set<TensorId> of_2;
    for (TensorId c : live) {
      if (c % 3 != 0) of_2.insert(c);
    }
    EXPECT_EQ(children_of(1), live);
    EXPECT_EQ(table.Find(1)->live_children, live.size());
    EXPECT_EQ(children_of(2), of_2);
    EXPECT_EQ(table.Find(2)->live_children, of_2.size());
  };
  // Freed in a scrambled order (37 is prime to 50), new children added
  // into the retired ones' slots along the way.
  TensorId next = 100;
  for (int i = 0; i < 50; ++i) {
    const TensorId c = 10 + (i * 37) % 50;
    ASSERT_TRUE(IsOk(table.Free(c)));
    live.erase(c);
    if (i % 10 == 0) {
      ASSERT_TRUE(IsOk(table.Add(Spec(next, 100, parents_of(next)), 0)));
      live.insert(next++);
    }
    expect_exact();
  }
  ASSERT_EQ(live.size(), 5u);
  for (TensorId c : std::set<TensorId>(live)) {
    ASSERT_TRUE(IsOk(table.Free(c)));
    live.erase(c);
    expect_exact();
  }
  EXPECT_THAT(table.Find(1)->children, IsEmpty());
  EXPECT_THAT(table.Find(2)->children, IsEmpty());
}

TEST(TensorTable, NewTensorInReusedSlotStartsClean) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 100), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 10, {1}), 0)));
  ASSERT_TRUE(IsOk(table.SetState(1, S::kEvicted)));
  ASSERT_TRUE(IsOk(table.MarkRecomputed(1, 0)));
  ASSERT_TRUE(IsOk(table.Lock(1)));
  ASSERT_TRUE(IsOk(table.Free(1)));
  ASSERT_TRUE(IsOk(table.Free(2)));
  ASSERT_EQ(table.size(), 0u);
  for (TensorId id : {3, 4}) {
    ASSERT_TRUE(IsOk(table.Add(Spec(id, 5), 0)));
    const Tensor* t = table.Find(id);
    EXPECT_EQ(t->state, S::kResident);
    EXPECT_EQ(t->recompute_count, 0u);
    EXPECT_EQ(t->lock_count, 0u);
    EXPECT_THAT(t->parents, IsEmpty());
    EXPECT_THAT(t->children, IsEmpty());
    EXPECT_EQ(t->live_children, 0u);
    EXPECT_FALSE(table.components().Contains(table.SlotOf(id)));
  }
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 10, .tensors = 2}));
  EXPECT_THAT(Ids(table, table.Candidates(GpuScope(0))), ElementsAre(3, 4));
}

TEST(TensorTable, RemoveSessionTakesAllItsTensorsAndLeavesOthers) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 100, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 100, {2}), 0)));
  ASSERT_TRUE(IsOk(table.SetState(3, TensorState::kEvicted)));
  ASSERT_TRUE(IsOk(table.SetState(2, TensorState::kEvicted)));
  ASSERT_TRUE(IsOk(table.Free(1)));                      // kept: 2 may need it
  ASSERT_TRUE(IsOk(table.Add(Spec(10, 50, {}, 2), 0)));  // another session
  table.RemoveSession(1);
  EXPECT_FALSE(table.Contains(1));
  EXPECT_FALSE(table.Contains(2));
  EXPECT_FALSE(table.Contains(3));
  EXPECT_EQ(table.components().size(), 0u);
  EXPECT_TRUE(StatsAre(table.SessionStats(1), {}));
  EXPECT_TRUE(StatsAre(table.SessionStats(2), {.device = 50, .tensors = 1}));
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 50, .tensors = 1}));
  EXPECT_EQ(table.Candidates(Scope{0, std::nullopt}).size(), 1u);
  // Gone for good: the session may start again on another GPU.
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 100, {}, 1, 2), 0)));
}

TEST(TensorTable, RemovingASessionWithALongEvictedChainEmptiesTheTable) {
  // Freeing a chain's tensors one by one re-forms its evicted component at
  // every step (quadratic: minutes at this size), which RemoveSession
  // avoids; rpc_bench's session close (--free_before_close=false) times it.
  TensorTable table;
  constexpr TensorId kN = 200000;
  for (TensorId id = 1; id <= kN; ++id) {
    std::vector<TensorId> parents;
    if (id > 1) parents.push_back(id - 1);
    ASSERT_TRUE(IsOk(table.Add(Spec(id, 100, parents), 0)));
    if (id % 2 == 0) {
      ASSERT_TRUE(IsOk(table.SetState(id, TensorState::kEvicted)));
    }
  }
  for (TensorId id = 1; id <= kN; id += 2) ASSERT_TRUE(IsOk(table.Free(id)));
  table.RemoveSession(1);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.components().size(), 0u);
}

TEST(TensorTable, SessionsEndingGiveTheirSlotsBackLowestReusedFirst) {
  TensorTable table;
  constexpr TensorId kN = 30000;
  for (TensorId id = 1; id <= 2 * kN; ++id) {
    ASSERT_TRUE(IsOk(table.Add(Spec(id, 100, {}, id <= kN ? 1 : 2), 0)));
  }
  ASSERT_EQ(table.slot_count(), 2 * kN);
  const Tensor* base = &table.AtSlot(0);
  const size_t high_water = ResidentBytes(base, 2 * kN * sizeof(Tensor));
  ASSERT_GE(high_water, 2 * kN * sizeof(Tensor) / 2);

  // Session 2 holds the end of the array: nothing can be cut yet, but a
  // newcomer fills the lowest slots session 1 left.
  table.RemoveSession(1);
  EXPECT_EQ(table.slot_count(), 2 * kN);
  for (TensorId id = 1; id <= 1000; ++id) {
    ASSERT_TRUE(IsOk(table.Add(Spec(100000 + id, 100, {}, 3), 0)));
    ASSERT_EQ(table.SlotOf(100000 + id), id - 1);
  }
  // Once session 2 ends, the array ends after session 3's tensors, and the
  // pages past them go back to the kernel (in whole 2 MiB pages).
  table.RemoveSession(2);
  EXPECT_EQ(table.slot_count(), 1000u);
  EXPECT_LE(ResidentBytes(base, 2 * kN * sizeof(Tensor)),
            1000 * sizeof(Tensor) + 2 * (size_t{2} << 20));
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100000, .tensors = 1000}));
  EXPECT_EQ(table.Candidates(GpuScope(0)).size(), 1000u);
  // The table works on: new tensors take the next slots, old ones are found.
  ASSERT_TRUE(IsOk(table.Add(Spec(7, 100, {100001}, 3), 0)));
  EXPECT_EQ(table.SlotOf(7), 1000u);
  EXPECT_EQ(table.Find(100500)->id, 100500u);
  table.RemoveSession(3);
  EXPECT_EQ(table.slot_count(), 0u);
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable,
     FreedSlotsAreReusedLowestFirstAndTheArrayEndsAtTheLastLiveOne) {
  TensorTable table;
  for (TensorId id = 1; id <= 10; ++id) {
    ASSERT_TRUE(IsOk(table.Add(Spec(id), 0)));
  }
  // A stack would hand back slot 7 (tensor 8's, freed last) first; the
  // array keeps its end while slot 9 lives.
  for (TensorId id : {4, 3, 8}) ASSERT_TRUE(IsOk(table.Free(id)));
  EXPECT_EQ(table.slot_count(), 10u);
  ASSERT_TRUE(IsOk(table.Add(Spec(11), 0)));
  EXPECT_EQ(table.SlotOf(11), 2u);
  // Once the last ones go, the array ends after the last live tensor.
  for (TensorId id : {10, 9}) ASSERT_TRUE(IsOk(table.Free(id)));
  EXPECT_EQ(table.slot_count(), 7u);  // slots 0-6; 7 and 8 cut off
  ASSERT_TRUE(IsOk(table.Add(Spec(12), 0)));
  EXPECT_EQ(table.SlotOf(12), 3u);
  ASSERT_TRUE(IsOk(table.Add(Spec(13), 0)));
  EXPECT_EQ(table.SlotOf(13), 7u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 800, .tensors = 8}));
}

TEST(TensorTable, IdZeroIsRejected) {
  TensorTable table;
  EXPECT_TRUE(IsError(table.Add(Spec(0), 0), absl::StatusCode::kInvalidArgument,
                      {"tensor id 0 is reserved"}));
  EXPECT_EQ(table.size(), 0u);
}

}  // namespace
}  // namespace deltad::policy
