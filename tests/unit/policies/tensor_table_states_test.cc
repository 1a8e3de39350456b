#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/legal_transitions.h"
#include "tests/unit/policies/status_assertions.h"
#include "tests/unit/policies/tensor_table_test_helpers.h"

namespace deltad::policy {
namespace {

using testing_util::Expected;
using testing_util::GpuScope;
using testing_util::IsError;
using testing_util::IsOk;
using testing_util::kAllStates;
using testing_util::Reach;
using testing_util::SessionScope;
using testing_util::Spec;
using testing_util::StateOf;
using testing_util::StatsAre;
using testing_util::StatsOf100In;
using S = TensorState;

// --- State changes
// ------------------------------------------------------------

TEST(TensorTable, StatsFollowEveryLegalTransition) {
  for (S from : kAllStates) {
    for (S to : kAllStates) {
      if (!testing_util::LegalTransition(from, to)) continue;
      SCOPED_TRACE(
          absl::StrCat(TensorStateName(from), " -> ", TensorStateName(to)));
      TensorTable table;
      ASSERT_TRUE(IsOk(table.Add(Spec(1, 100, {}, /*session=*/7, /*gpu=*/2),
                                 /*now_ns=*/0)));
      Reach(table, 1, from);
      ASSERT_TRUE(StatsAre(table.GpuStats(2), StatsOf100In(from)));
      ASSERT_TRUE(IsOk(table.SetState(1, to)));
      EXPECT_EQ(StateOf(table, 1), to);
      EXPECT_TRUE(StatsAre(table.GpuStats(2), StatsOf100In(to)));
      EXPECT_TRUE(StatsAre(table.SessionStats(7), StatsOf100In(to)));
      EXPECT_TRUE(StatsAre(table.GpuStats(0), {}));
      const MemoryStats st = table.GpuStats(2);
      EXPECT_EQ(st.committed_bytes(),
                to == S::kResident || to == S::kReloading ? 100 : 0);
      const bool resident = to == S::kResident;
      EXPECT_EQ(table.Candidates(GpuScope(2)).size(), resident ? 1u : 0u);
      EXPECT_EQ(table.Candidates(SessionScope(2, 7)).size(),
                resident ? 1u : 0u);
      EXPECT_EQ(table.CandidateBytes(GpuScope(2)), resident ? 100 : 0);
      EXPECT_EQ(table.CandidateBytes(SessionScope(2, 7)), resident ? 100 : 0);
      const uint32_t slot = table.SlotOf(1);
      EXPECT_EQ(table.components().Contains(slot), to == S::kEvicted);
    }
  }
}

TEST(TensorTable, FullSwapCycleAccountsEachStep) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 100), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 30), 0)));
  const Expected other = {.device = 30, .tensors = 1};
  auto with_other = [&](S s) {
    Expected e = StatsOf100In(s);
    e.device += other.device;
    e.tensors += other.tensors;
    return e;
  };
  for (S s : {S::kOffloading, S::kOffloaded, S::kReloading, S::kResident,
              S::kEvicted}) {
    SCOPED_TRACE(TensorStateName(s));
    if (s == S::kEvicted) {
      ASSERT_TRUE(IsOk(table.SetState(1, S::kOffloading)));
      ASSERT_TRUE(IsOk(table.SetState(1, S::kOffloaded)));
    }
    ASSERT_TRUE(IsOk(table.SetState(1, s)));
    EXPECT_TRUE(StatsAre(table.GpuStats(0), with_other(s)));
    EXPECT_TRUE(StatsAre(table.SessionStats(1), with_other(s)));
  }
}

TEST(TensorTable, IllegalTransitionsAreFailedPreconditionAndChangeNothing) {
  for (S from : kAllStates) {
    for (S to : kAllStates) {
      if (testing_util::LegalTransition(from, to)) continue;
      SCOPED_TRACE(
          absl::StrCat(TensorStateName(from), " -> ", TensorStateName(to)));
      TensorTable table;
      ASSERT_TRUE(IsOk(table.Add(Spec(1, 100), 0)));
      // A child keeps a freed 1 in the table.
      ASSERT_TRUE(IsOk(table.Add(Spec(2, 1, {1}), 0)));
      Reach(table, 1, from);
      const MemoryStats before = table.GpuStats(0);
      const size_t candidates = table.Candidates(GpuScope(0)).size();
      const size_t members = table.components().size();

      const absl::Status s = table.SetState(1, to);
      EXPECT_TRUE(IsError(
          s, absl::StatusCode::kFailedPrecondition,
          {"tensor 1", absl::StrCat("cannot go from ", TensorStateName(from),
                                    " to ", TensorStateName(to))}));
      EXPECT_EQ(StateOf(table, 1), from);
      const MemoryStats after = table.GpuStats(0);
      EXPECT_TRUE(StatsAre(after, {.device = before.device_bytes,
                                   .releasing = before.releasing_bytes,
                                   .host = before.host_bytes,
                                   .evicted = before.evicted_bytes,
                                   .tensors = before.tensors}));
      EXPECT_EQ(table.Candidates(GpuScope(0)).size(), candidates);
      EXPECT_EQ(table.components().size(), members);
    }
  }
}

TEST(TensorTable, RefusesToEvictUncomputableTensor) {
  TensorTable table;
  TensorSpec spec = Spec(1);
  spec.flags.uncomputable = true;
  ASSERT_TRUE(IsOk(table.Add(spec, 0)));
  EXPECT_TRUE(IsError(table.SetState(1, S::kEvicted),
                      absl::StatusCode::kFailedPrecondition,
                      {"tensor 1", "uncomputable"}));
  EXPECT_EQ(StateOf(table, 1), S::kResident);
  // Nor may its host copy be dropped once offloaded.
  Reach(table, 1, S::kOffloaded);
  EXPECT_TRUE(IsError(table.SetState(1, S::kEvicted),
                      absl::StatusCode::kFailedPrecondition, {"uncomputable"}));
  EXPECT_EQ(StateOf(table, 1), S::kOffloaded);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.host = 100, .tensors = 1}));
  EXPECT_EQ(table.components().size(), 0u);
}

TEST(TensorTable, RefusesToEvictEvictPinnedTensor) {
  TensorTable table;
  TensorSpec spec = Spec(1);
  spec.flags.evict_pinned = true;
  ASSERT_TRUE(IsOk(table.Add(spec, 0)));
  EXPECT_TRUE(IsError(table.SetState(1, S::kEvicted),
                      absl::StatusCode::kFailedPrecondition,
                      {"tensor 1", "evict-pinned"}));
  EXPECT_EQ(StateOf(table, 1), S::kResident);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100, .tensors = 1}));
  // Offloading is what it is for.
  EXPECT_TRUE(IsOk(table.SetState(1, S::kOffloading)));
  EXPECT_TRUE(IsOk(table.SetState(1, S::kOffloaded)));
  EXPECT_TRUE(IsError(table.SetState(1, S::kEvicted),
                      absl::StatusCode::kFailedPrecondition, {"evict-pinned"}));
  EXPECT_EQ(StateOf(table, 1), S::kOffloaded);
}

TEST(TensorTable, RefusesToOffloadOffloadPinnedTensor) {
  TensorTable table;
  TensorSpec spec = Spec(1);
  spec.flags.offload_pinned = true;
  ASSERT_TRUE(IsOk(table.Add(spec, 0)));
  EXPECT_TRUE(IsError(table.SetState(1, S::kOffloading),
                      absl::StatusCode::kFailedPrecondition,
                      {"tensor 1", "offload-pinned"}));
  EXPECT_EQ(StateOf(table, 1), S::kResident);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100, .tensors = 1}));
  // Evicting is allowed.
  EXPECT_TRUE(IsOk(table.SetState(1, S::kEvicted)));
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.evicted = 100, .tensors = 1}));
}

TEST(TensorTable, LockedTensorCannotBeReleased) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.Lock(1)));
  ASSERT_TRUE(IsOk(table.Lock(1)));
  EXPECT_EQ(table.Find(1)->lock_count, 2u);
  for (S to : {S::kEvicted, S::kOffloading}) {
    EXPECT_TRUE(IsError(table.SetState(1, to),
                        absl::StatusCode::kFailedPrecondition,
                        {"tensor 1", "locked"}));
    EXPECT_EQ(StateOf(table, 1), S::kResident);
  }
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100, .tensors = 1}));
  EXPECT_EQ(table.Candidates(GpuScope(0)).size(), 1u);

  ASSERT_TRUE(IsOk(table.Unlock(1)));  // still held once
  EXPECT_TRUE(IsError(table.SetState(1, S::kEvicted),
                      absl::StatusCode::kFailedPrecondition, {"locked"}));
  ASSERT_TRUE(IsOk(table.Unlock(1)));
  EXPECT_EQ(table.Find(1)->lock_count, 0u);
  EXPECT_TRUE(IsOk(table.SetState(1, S::kEvicted)));
}

TEST(TensorTable, UnlockWithoutLockIsFailedPrecondition) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  EXPECT_TRUE(IsError(table.Unlock(1), absl::StatusCode::kFailedPrecondition,
                      {"tensor 1 is not locked"}));
  EXPECT_EQ(table.Find(1)->lock_count, 0u);
}

TEST(TensorTable, LockOfFreedTensorIsRefused) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 10, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Free(1)));
  EXPECT_TRUE(IsError(table.Lock(1), absl::StatusCode::kFailedPrecondition,
                      {"tensor 1 was freed"}));
  EXPECT_EQ(table.Find(1)->lock_count, 0u);
}

TEST(TensorTable, FreeOfLockedTensorSucceeds) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 10, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Lock(1)));
  ASSERT_TRUE(IsOk(table.Free(1)));
  EXPECT_EQ(StateOf(table, 1), S::kFreed);
  EXPECT_EQ(table.Find(1)->lock_count, 0u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 10, .tensors = 1}));
}

TEST(TensorTable, CancelReleaseRestoresResidentWithoutCountingRecompute) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.SetState(1, S::kEvicted)));
  ASSERT_TRUE(table.components().Contains(table.SlotOf(1)));
  ASSERT_TRUE(IsOk(table.CancelRelease(1)));
  EXPECT_EQ(StateOf(table, 1), S::kResident);
  EXPECT_EQ(table.Find(1)->recompute_count, 0u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100, .tensors = 1}));
  EXPECT_EQ(table.CandidateBytes(GpuScope(0)), 100);
  EXPECT_FALSE(table.components().Contains(table.SlotOf(1)));

  ASSERT_TRUE(IsOk(table.SetState(1, S::kOffloading)));
  ASSERT_TRUE(IsOk(table.CancelRelease(1)));
  EXPECT_EQ(StateOf(table, 1), S::kResident);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100, .tensors = 1}));
  EXPECT_TRUE(StatsAre(table.SessionStats(1), {.device = 100, .tensors = 1}));
  EXPECT_EQ(table.Candidates(SessionScope(0, 1)).size(), 1u);
}

TEST(TensorTable, CancelReleaseRefusedWithoutReleaseInFlight) {
  for (S from : {S::kResident, S::kOffloaded, S::kReloading, S::kFreed}) {
    SCOPED_TRACE(TensorStateName(from));
    TensorTable table;
    ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
    ASSERT_TRUE(IsOk(table.Add(Spec(2, 1, {1}), 0)));
    Reach(table, 1, from);
    const MemoryStats before = table.GpuStats(0);
    EXPECT_TRUE(IsError(
        table.CancelRelease(1), absl::StatusCode::kFailedPrecondition,
        {"tensor 1", std::string(TensorStateName(from)), "no release"}));
    EXPECT_EQ(StateOf(table, 1), from);
    EXPECT_EQ(table.GpuStats(0).device_bytes, before.device_bytes);
    EXPECT_EQ(table.GpuStats(0).host_bytes, before.host_bytes);
  }
}

TEST(TensorTable, MarkRecomputedIncrementsRecomputeCount) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 10)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 50), 20)));
  for (uint32_t n = 1; n <= 3; ++n) {
    ASSERT_TRUE(IsOk(table.SetState(1, S::kEvicted)));
    ASSERT_TRUE(StatsAre(table.GpuStats(0),
                         {.device = 50, .evicted = 100, .tensors = 2}));
    ASSERT_TRUE(IsOk(table.MarkRecomputed(1, 100 * n)));
    const Tensor* t = table.Find(1);
    EXPECT_EQ(t->state, S::kResident);
    EXPECT_EQ(t->recompute_count, n);
    EXPECT_EQ(t->last_access_ns, static_cast<int64_t>(100 * n));
    EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 150, .tensors = 2}));
    EXPECT_EQ(table.CandidateBytes(GpuScope(0)), 150);
    EXPECT_FALSE(table.components().Contains(table.SlotOf(1)));
  }
  EXPECT_EQ(table.Find(2)->recompute_count, 0u);
}

TEST(TensorTable, MarkRecomputedAdvancesSessionClock) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));  // tick 1
  ASSERT_TRUE(IsOk(table.Add(Spec(2), 0)));  // tick 2
  ASSERT_TRUE(IsOk(table.SetState(1, S::kEvicted)));
  ASSERT_TRUE(IsOk(table.MarkRecomputed(1, 0)));
  EXPECT_EQ(table.Find(1)->last_access_tick, 3u);
  EXPECT_EQ(table.Find(2)->last_access_tick, 2u);
}

TEST(TensorTable, MarkRecomputedOfOffloadedDropsHostCopy) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  Reach(table, 1, S::kOffloaded);
  ASSERT_TRUE(IsOk(table.MarkRecomputed(1, 5)));
  EXPECT_EQ(StateOf(table, 1), S::kResident);
  EXPECT_EQ(table.Find(1)->recompute_count, 1u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100, .tensors = 1}));
  EXPECT_EQ(table.CandidateBytes(GpuScope(0)), 100);
}

TEST(TensorTable, MarkRecomputedRefusesOtherStatesAndUncomputable) {
  for (S from : {S::kResident, S::kOffloading, S::kReloading, S::kFreed}) {
    SCOPED_TRACE(TensorStateName(from));
    TensorTable table;
    ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
    ASSERT_TRUE(IsOk(table.Add(Spec(2, 1, {1}), 0)));
    Reach(table, 1, from);
    EXPECT_TRUE(IsError(table.MarkRecomputed(1, 0),
                        absl::StatusCode::kFailedPrecondition,
                        {"tensor 1", std::string(TensorStateName(from)),
                         "only evicted or offloaded"}));
    EXPECT_EQ(StateOf(table, 1), from);
    EXPECT_EQ(table.Find(1)->recompute_count, 0u);
  }
  TensorTable table;
  TensorSpec spec = Spec(1);
  spec.flags.uncomputable = true;
  ASSERT_TRUE(IsOk(table.Add(spec, 0)));
  Reach(table, 1, S::kOffloaded);
  EXPECT_TRUE(IsError(table.MarkRecomputed(1, 0),
                      absl::StatusCode::kFailedPrecondition,
                      {"tensor 1 is uncomputable"}));
  EXPECT_EQ(StateOf(table, 1), S::kOffloaded);
  EXPECT_EQ(table.Find(1)->recompute_count, 0u);
}

TEST(TensorTable, CancelReleaseRefusesAnEvictionThatDroppedTheHostCopy) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.SetState(1, S::kOffloading)));
  ASSERT_TRUE(IsOk(table.SetState(1, S::kOffloaded)));
  ASSERT_TRUE(IsOk(table.SetState(1, S::kEvicted)));  // host copy dropped
  const absl::Status s = table.CancelRelease(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateOf(table, 1), S::kEvicted);
  EXPECT_EQ(table.GpuStats(0).device_bytes, 0);
  // Evicted straight from the device, it can be cancelled.
  ASSERT_TRUE(IsOk(table.Add(Spec(2), 0)));
  ASSERT_TRUE(IsOk(table.SetState(2, S::kEvicted)));
  EXPECT_TRUE(IsOk(table.CancelRelease(2)));
  EXPECT_EQ(StateOf(table, 2), S::kResident);
}

TEST(TensorTable, TensorStateNamesAreDistinct) {
  EXPECT_EQ(TensorStateName(S::kResident), "resident");
  EXPECT_EQ(TensorStateName(S::kOffloading), "offloading");
  EXPECT_EQ(TensorStateName(S::kOffloaded), "offloaded");
  EXPECT_EQ(TensorStateName(S::kReloading), "reloading");
  EXPECT_EQ(TensorStateName(S::kEvicted), "evicted");
  EXPECT_EQ(TensorStateName(S::kFreed), "freed");
}

// --- Access clock
// -------------------------------------------------------------

TEST(TensorTable, TouchAdvancesPerSessionClock) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 100, {}, 1), 100)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 100, {}, 1), 200)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 100, {}, 2), 300)));
  EXPECT_EQ(table.Find(1)->last_access_tick, 1u);
  EXPECT_EQ(table.Find(2)->last_access_tick, 2u);
  EXPECT_EQ(table.Find(3)->last_access_tick, 1u);  // its own session's clock
  EXPECT_EQ(table.Find(1)->last_access_ns, 100);

  ASSERT_TRUE(IsOk(table.Touch(1, 500)));
  EXPECT_EQ(table.Find(1)->last_access_tick, 3u);
  EXPECT_EQ(table.Find(1)->last_access_ns, 500);
  ASSERT_TRUE(IsOk(table.Touch(3, 600)));
  EXPECT_EQ(table.Find(3)->last_access_tick, 2u);
  EXPECT_EQ(table.Find(3)->last_access_ns, 600);
  ASSERT_TRUE(IsOk(table.Touch(1, 700)));
  EXPECT_EQ(table.Find(1)->last_access_tick, 4u);
  // Untouched tensors keep their tick.
  EXPECT_EQ(table.Find(2)->last_access_tick, 2u);
  EXPECT_EQ(table.Find(2)->last_access_ns, 200);
  // Touching changes no bytes.
  EXPECT_TRUE(StatsAre(table.SessionStats(1), {.device = 200, .tensors = 2}));
}

TEST(TensorTable, TouchRefusesTensorsNotOnTheDevice) {
  for (S from : {S::kOffloaded, S::kEvicted, S::kFreed}) {
    SCOPED_TRACE(TensorStateName(from));
    TensorTable table;
    ASSERT_TRUE(IsOk(table.Add(Spec(1), 10)));          // tick 1
    ASSERT_TRUE(IsOk(table.Add(Spec(2, 1, {1}), 20)));  // tick 2
    Reach(table, 1, from);
    EXPECT_TRUE(IsError(table.Touch(1, 99),
                        absl::StatusCode::kFailedPrecondition,
                        {"tensor 1 is " + std::string(TensorStateName(from))}));
    EXPECT_EQ(table.Find(1)->last_access_tick, 1u);
    EXPECT_EQ(table.Find(1)->last_access_ns, 10);
    // The refused touch did not advance the clock.
    ASSERT_TRUE(IsOk(table.Touch(2, 30)));
    EXPECT_EQ(table.Find(2)->last_access_tick, 3u);
  }
}

TEST(TensorTable, AHostCopyIsMarkedOnAResidentTensorAndClearedWhenItLeaves) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.SetHostCopy(1, true)));
  EXPECT_TRUE(table.Find(1)->flags.host_copy);
  // The candidate lists' entries carry it too: the Filter prices from them.
  for (const Scope& scope : {GpuScope(0), SessionScope(0, 1)}) {
    ASSERT_EQ(table.CandidateEntries(scope).size(), 1u);
    EXPECT_TRUE(table.CandidateEntries(scope)[0].flags.host_copy);
  }
  ASSERT_TRUE(IsOk(table.SetState(1, S::kOffloading)));
  EXPECT_FALSE(table.Find(1)->flags.host_copy);
  EXPECT_TRUE(IsError(table.SetHostCopy(1, true),
                      absl::StatusCode::kFailedPrecondition,
                      {"tensor 1 is offloading"}));
  // Back on the device, it has no copy unless one is marked again.
  ASSERT_TRUE(IsOk(table.CancelRelease(1)));
  EXPECT_FALSE(table.Find(1)->flags.host_copy);
  EXPECT_FALSE(table.CandidateEntries(GpuScope(0))[0].flags.host_copy);
  EXPECT_TRUE(
      IsError(table.SetHostCopy(2, true), absl::StatusCode::kNotFound, {"2"}));
}

}  // namespace
}  // namespace deltad::policy
