#include "policies/tensor_table.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/tensor.h"
#include "tests/unit/policies/legal_transitions.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using S = TensorState;

constexpr S kAllStates[] = {S::kResident,  S::kOffloading, S::kOffloaded,
                            S::kReloading, S::kEvicted,    S::kFreed};

testing::AssertionResult IsOk(const absl::Status& s) {
  if (s.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << s.ToString();
}

// The status has `code` and its message contains every one of `parts`.
testing::AssertionResult IsError(const absl::Status& s, absl::StatusCode code,
                                 std::vector<std::string> parts = {}) {
  if (s.code() != code) {
    return testing::AssertionFailure()
           << "expected code " << absl::StatusCodeToString(code) << ", got "
           << s.ToString();
  }
  const std::string message(s.message());
  for (const std::string& p : parts) {
    if (message.find(p) == std::string::npos) {
      return testing::AssertionFailure()
             << "message \"" << message << "\" lacks \"" << p << "\"";
    }
  }
  return testing::AssertionSuccess();
}

struct Expected {
  int64_t device = 0;
  int64_t releasing = 0;
  int64_t host = 0;
  int64_t evicted = 0;
  int64_t tensors = 0;
};

testing::AssertionResult StatsAre(const MemoryStats& s, const Expected& e) {
  if (s.device_bytes == e.device && s.releasing_bytes == e.releasing &&
      s.host_bytes == e.host && s.evicted_bytes == e.evicted &&
      s.tensors == e.tensors) {
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure()
         << "got device=" << s.device_bytes
         << " releasing=" << s.releasing_bytes << " host=" << s.host_bytes
         << " evicted=" << s.evicted_bytes << " tensors=" << s.tensors
         << "; want device=" << e.device << " releasing=" << e.releasing
         << " host=" << e.host << " evicted=" << e.evicted
         << " tensors=" << e.tensors;
}

// Stats of one 100-byte tensor in each state, written out by hand.
Expected StatsOf100In(S state) {
  switch (state) {
    case S::kResident:
      return {.device = 100, .tensors = 1};
    case S::kOffloading:
      return {.device = 100, .releasing = 100, .host = 100, .tensors = 1};
    case S::kOffloaded:
      return {.host = 100, .tensors = 1};
    case S::kReloading:
      return {.device = 100, .host = 100, .tensors = 1};
    case S::kEvicted:
      return {.evicted = 100, .tensors = 1};
    case S::kFreed:
      return {};
  }
  return {};
}

Scope GpuScope(GpuId gpu) {
  Scope s;
  s.gpu = gpu;
  return s;
}

Scope SessionScope(GpuId gpu, SessionId session) {
  Scope s;
  s.gpu = gpu;
  s.session = session;
  return s;
}

TensorSpec Spec(TensorId id, int64_t bytes = 100,
                std::vector<TensorId> parents = {}, SessionId session = 1,
                GpuId gpu = 0) {
  TensorSpec s;
  s.id = id;
  s.bytes = bytes;
  s.parents = std::move(parents);
  s.session = session;
  s.gpu = gpu;
  return s;
}

// Moves the resident tensor `id` to `state` through legal calls. kFreed is
// reached with Free(); the caller gives it a live child if it must stay.
void Reach(TensorTable& table, TensorId id, S state) {
  switch (state) {
    case S::kResident:
      return;
    case S::kOffloading:
      ASSERT_TRUE(IsOk(table.SetState(id, S::kOffloading)));
      return;
    case S::kOffloaded:
      ASSERT_TRUE(IsOk(table.SetState(id, S::kOffloading)));
      ASSERT_TRUE(IsOk(table.SetState(id, S::kOffloaded)));
      return;
    case S::kReloading:
      ASSERT_TRUE(IsOk(table.SetState(id, S::kOffloading)));
      ASSERT_TRUE(IsOk(table.SetState(id, S::kOffloaded)));
      ASSERT_TRUE(IsOk(table.SetState(id, S::kReloading)));
      return;
    case S::kEvicted:
      ASSERT_TRUE(IsOk(table.SetState(id, S::kEvicted)));
      return;
    case S::kFreed:
      ASSERT_TRUE(IsOk(table.Free(id)));
      return;
  }
}

std::vector<TensorId> Ids(const TensorTable& table,
                          absl::Span<const uint32_t> slots) {
  std::vector<TensorId> ids;
  for (uint32_t s : slots) ids.push_back(table.AtSlot(s).id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

S StateOf(const TensorTable& table, TensorId id) {
  const Tensor* t = table.Find(id);
  EXPECT_NE(t, nullptr) << "tensor " << id;
  return t == nullptr ? S::kFreed : t->state;
}

// --- Adding -----------------------------------------------------------------

TEST(TensorTable, AddMakesTensorResidentAndAccountsItsBytes) {
  TensorTable table;
  TensorSpec spec = Spec(7, 300, {}, /*session=*/4, /*gpu=*/2);
  spec.compute_cost_ns = 55;
  spec.stable_key = 9;
  spec.flags.offload_pinned = true;
  ASSERT_TRUE(IsOk(table.Add(spec, /*now_ns=*/1000)));

  const Tensor* t = table.Find(7);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->state, S::kResident);
  EXPECT_EQ(t->session, 4u);
  EXPECT_EQ(t->gpu, 2);
  EXPECT_EQ(t->bytes, 300);
  EXPECT_EQ(t->compute_cost_ns, 55);
  EXPECT_EQ(t->stable_key, 9u);
  EXPECT_TRUE(t->flags.offload_pinned);
  EXPECT_EQ(t->last_access_ns, 1000);
  EXPECT_EQ(t->recompute_count, 0u);
  EXPECT_TRUE(table.Contains(7));
  EXPECT_EQ(table.size(), 1u);
  auto got = table.Get(7);
  ASSERT_TRUE(IsOk(got.status()));
  EXPECT_EQ(*got, t);
  EXPECT_EQ(&table.AtSlot(table.SlotOf(7)), t);

  EXPECT_TRUE(StatsAre(table.GpuStats(2), {.device = 300, .tensors = 1}));
  EXPECT_TRUE(StatsAre(table.SessionStats(4), {.device = 300, .tensors = 1}));
  EXPECT_TRUE(
      StatsAre(table.ScopeStats(GpuScope(2)), {.device = 300, .tensors = 1}));
  EXPECT_TRUE(StatsAre(table.ScopeStats(SessionScope(0, 4)),
                       {.device = 300, .tensors = 1}));
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {}));
  EXPECT_TRUE(StatsAre(table.SessionStats(1), {}));
}

TEST(TensorTable, RejectsZeroSize) {
  TensorTable table;
  const absl::Status s = table.Add(Spec(3, 0), 0);
  EXPECT_TRUE(IsError(s, absl::StatusCode::kInvalidArgument,
                      {"tensor 3", "size must be positive", "got 0"}));
  EXPECT_FALSE(table.Contains(3));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {}));
}

TEST(TensorTable, RejectsNegativeSize) {
  TensorTable table;
  const absl::Status s = table.Add(Spec(3, -64), 0);
  EXPECT_TRUE(IsError(s, absl::StatusCode::kInvalidArgument,
                      {"tensor 3", "size must be positive", "-64"}));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_TRUE(StatsAre(table.SessionStats(1), {}));
}

TEST(TensorTable, RejectsNegativeGpu) {
  TensorTable table;
  const absl::Status s = table.Add(Spec(3, 10, {}, 1, -1), 0);
  EXPECT_TRUE(IsError(s, absl::StatusCode::kInvalidArgument,
                      {"tensor 3", "negative GPU index -1"}));
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable, RejectsNegativeComputeCost) {
  TensorTable table;
  TensorSpec spec = Spec(3);
  spec.compute_cost_ns = -5;
  EXPECT_TRUE(IsError(table.Add(spec, 0), absl::StatusCode::kInvalidArgument,
                      {"tensor 3", "negative compute cost -5"}));
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable, RejectsDuplicateIdAlreadyInTable) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(5, 100), 0)));
  EXPECT_TRUE(IsError(table.Add(Spec(5, 999), 0),
                      absl::StatusCode::kAlreadyExists,
                      {"duplicate tensor id 5"}));
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(table.Find(5)->bytes, 100);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 100, .tensors = 1}));
}

TEST(TensorTable, RejectsDuplicateIdWithinOneBatch) {
  TensorTable table;
  const std::vector<TensorSpec> batch = {Spec(1), Spec(2), Spec(1, 50)};
  EXPECT_TRUE(IsError(table.AddBatch(batch, 0),
                      absl::StatusCode::kAlreadyExists,
                      {"duplicate tensor id 1", "in one batch"}));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_FALSE(table.Contains(1));
  EXPECT_FALSE(table.Contains(2));
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {}));
}

TEST(TensorTable, RejectsParentThatDoesNotExist) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  EXPECT_TRUE(IsError(table.Add(Spec(2, 100, {1, 99}), 0),
                      absl::StatusCode::kNotFound,
                      {"tensor 2", "parent 99 does not exist"}));
  EXPECT_FALSE(table.Contains(2));
  EXPECT_THAT(table.Find(1)->children, IsEmpty());
  EXPECT_EQ(table.Find(1)->live_children, 0u);
}

TEST(TensorTable, RejectsParentOfAnotherSession) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 100, {}, /*session=*/1), 0)));
  EXPECT_TRUE(IsError(table.Add(Spec(2, 100, {1}, /*session=*/2), 0),
                      absl::StatusCode::kPermissionDenied,
                      {"tensor 2", "parent 1", "another session"}));
  EXPECT_FALSE(table.Contains(2));
  EXPECT_TRUE(StatsAre(table.SessionStats(2), {}));
  EXPECT_THAT(table.Find(1)->children, IsEmpty());
}

TEST(TensorTable, RejectsParentOfAnotherSessionInSameBatch) {
  TensorTable table;
  const std::vector<TensorSpec> batch = {Spec(2, 100, {1}, /*session=*/2),
                                         Spec(1, 100, {}, /*session=*/1)};
  EXPECT_TRUE(IsError(table.AddBatch(batch, 0),
                      absl::StatusCode::kPermissionDenied,
                      {"tensor 2", "parent 1", "another session"}));
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable, RejectsFreedParent) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 100, {1}), 0)));
  ASSERT_TRUE(IsOk(table.Free(1)));  // kept: 2 still needs it
  ASSERT_EQ(StateOf(table, 1), S::kFreed);
  EXPECT_TRUE(IsError(table.Add(Spec(3, 100, {1}), 0),
                      absl::StatusCode::kFailedPrecondition,
                      {"tensor 3", "parent 1 was freed"}));
  EXPECT_FALSE(table.Contains(3));
}

TEST(TensorTable, AddBatchRejectsSelfParent) {
  TensorTable table;
  EXPECT_TRUE(IsError(table.Add(Spec(4, 100, {4}), 0),
                      absl::StatusCode::kInvalidArgument,
                      {"tensor 4", "itself", "cycle"}));
  const std::vector<TensorSpec> batch = {Spec(1), Spec(2, 100, {1, 2})};
  EXPECT_TRUE(IsError(table.AddBatch(batch, 0),
                      absl::StatusCode::kInvalidArgument,
                      {"tensor 2", "itself", "cycle"}));
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable, AddBatchRejectsCycle) {
  TensorTable table;
  // 1 <- 2 <- 3 <- 1, plus an innocent 4.
  const std::vector<TensorSpec> batch = {Spec(4), Spec(1, 100, {3}),
                                         Spec(2, 100, {1}), Spec(3, 100, {2})};
  const absl::Status s = table.AddBatch(batch, 0);
  EXPECT_TRUE(IsError(s, absl::StatusCode::kInvalidArgument, {"cycle"}));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_FALSE(table.Contains(4));
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {}));
}

TEST(TensorTable, AddBatchCycleMessageNamesATensorOnTheCycle) {
  TensorTable table;
  // 30 hangs below the cycle 21 <-> 22 and comes first in the batch: it is
  // blocked by the cycle but is not its own ancestor.
  const std::vector<TensorSpec> batch = {
      Spec(30, 100, {21}), Spec(21, 100, {22}), Spec(22, 100, {21})};
  const absl::Status s = table.AddBatch(batch, 0);
  ASSERT_TRUE(IsError(s, absl::StatusCode::kInvalidArgument, {"cycle"}));
  const std::string message(s.message());
  EXPECT_EQ(message.find("tensor 30"), std::string::npos) << message;
  EXPECT_TRUE(message.find("tensor 21") != std::string::npos ||
              message.find("tensor 22") != std::string::npos)
      << message;
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable, AddBatchIsAllOrNothing) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 10), 0)));
  const Expected before = {.device = 10, .tensors = 1};

  // Each batch has valid tensors (children of 1 among them) and one fault,
  // last, so that an implementation adding as it validates would be caught.
  const std::vector<std::vector<TensorSpec>> bad_batches = {
      {Spec(10, 100, {1}), Spec(11, 100, {10}), Spec(12, 100, {99})},
      {Spec(10, 100, {1}), Spec(11, 100, {10}), Spec(12, 0)},
      {Spec(10, 100, {1}), Spec(11, 100, {10}), Spec(1)},
      {Spec(10, 100, {1}), Spec(11, 100, {10}), Spec(11, 5)},
      {Spec(10, 100, {1}), Spec(11, 100, {10}), Spec(12, 100, {13}),
       Spec(13, 100, {12})},
      {Spec(10, 100, {1}), Spec(11, 100, {10}), Spec(12, 100, {1}, 2)},
  };
  for (size_t i = 0; i < bad_batches.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("batch ", i));
    EXPECT_FALSE(table.AddBatch(bad_batches[i], 0).ok());
    EXPECT_EQ(table.size(), 1u);
    for (TensorId id : {10, 11, 12, 13}) EXPECT_FALSE(table.Contains(id)) << id;
    EXPECT_TRUE(StatsAre(table.GpuStats(0), before));
    EXPECT_TRUE(StatsAre(table.SessionStats(1), before));
    EXPECT_TRUE(StatsAre(table.SessionStats(2), {}));
    EXPECT_THAT(table.Find(1)->children, IsEmpty());
    EXPECT_EQ(table.Find(1)->live_children, 0u);
    EXPECT_THAT(Ids(table, table.Candidates(GpuScope(0))), ElementsAre(1));
  }
  // Nothing half-added is in the way of the same tensors done right.
  const std::vector<TensorSpec> good = {Spec(10, 100, {1}),
                                        Spec(11, 100, {10})};
  ASSERT_TRUE(IsOk(table.AddBatch(good, 0)));
  EXPECT_EQ(table.size(), 3u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 210, .tensors = 3}));
}

TEST(TensorTable, AddBatchAcceptsForwardReferencesInAnyOrder) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 1), 0)));
  // Children before their parents; 5 depends on a tensor already in the
  // table and on one later in the batch.
  const std::vector<TensorSpec> batch = {Spec(5, 5, {4, 1}), Spec(4, 4, {3}),
                                         Spec(3, 3, {2}), Spec(2, 2, {1})};
  ASSERT_TRUE(IsOk(table.AddBatch(batch, 0)));
  EXPECT_EQ(table.size(), 5u);
  EXPECT_TRUE(StatsAre(table.GpuStats(0), {.device = 15, .tensors = 5}));

  auto parent_ids = [&](TensorId id) {
    return Ids(table, table.Find(id)->parents);
  };
  auto child_ids = [&](TensorId id) {
    return Ids(table, table.Find(id)->children);
  };
  EXPECT_THAT(parent_ids(5), ElementsAre(1, 4));
  EXPECT_THAT(parent_ids(4), ElementsAre(3));
  EXPECT_THAT(parent_ids(3), ElementsAre(2));
  EXPECT_THAT(parent_ids(2), ElementsAre(1));
  EXPECT_THAT(child_ids(1), ElementsAre(2, 5));
  EXPECT_EQ(table.Find(1)->live_children, 2u);
  EXPECT_THAT(child_ids(4), ElementsAre(5));
  EXPECT_THAT(child_ids(5), IsEmpty());
  for (TensorId id : {1, 2, 3, 4, 5}) {
    EXPECT_EQ(StateOf(table, id), S::kResident);
  }
}

TEST(TensorTable, ParentListedTwiceIsLinkedOnce) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  const std::vector<TensorSpec> batch = {Spec(3, 100, {2, 2, 1, 1}),
                                         Spec(2, 100, {1})};
  ASSERT_TRUE(IsOk(table.AddBatch(batch, 0)));
  EXPECT_EQ(table.Find(3)->parents.size(), 2u);
  EXPECT_EQ(table.Find(1)->children.size(), 2u);
  EXPECT_EQ(table.Find(1)->live_children, 2u);
  EXPECT_EQ(table.Find(2)->live_children, 1u);
  // Freeing the child once must release the parent completely.
  ASSERT_TRUE(IsOk(table.Free(1)));
  ASSERT_TRUE(IsOk(table.Free(2)));
  ASSERT_TRUE(IsOk(table.Free(3)));
  EXPECT_EQ(table.size(), 0u);
}

TEST(TensorTable, UnknownIdIsNotFound) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  const std::vector<std::string> what = {"unknown tensor id 42"};
  const auto kNotFound = absl::StatusCode::kNotFound;
  EXPECT_TRUE(IsError(table.Touch(42, 0), kNotFound, what));
  EXPECT_TRUE(IsError(table.Free(42), kNotFound, what));
  EXPECT_TRUE(IsError(table.SetState(42, S::kEvicted), kNotFound, what));
  EXPECT_TRUE(IsError(table.CancelRelease(42), kNotFound, what));
  EXPECT_TRUE(IsError(table.MarkRecomputed(42, 0), kNotFound, what));
  EXPECT_TRUE(IsError(table.Lock(42), kNotFound, what));
  EXPECT_TRUE(IsError(table.Unlock(42), kNotFound, what));
  EXPECT_TRUE(IsError(table.SetAdjacentFreeBytes(42, 1), kNotFound, what));
  EXPECT_TRUE(IsError(table.Get(42).status(), kNotFound, what));
  EXPECT_EQ(table.Find(42), nullptr);
  EXPECT_EQ(table.SlotOf(42), UINT32_MAX);
  EXPECT_FALSE(table.Contains(42));
}

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

// --- Candidates, scopes, keys
// -------------------------------------------------

TEST(TensorTable, CandidatesHoldExactlyResidentTensorsOfScope) {
  TensorTable table;
  // GPU 0: session 1 has 1, 2, 5; session 2 has 3. GPU 1: session 3 has 4.
  ASSERT_TRUE(IsOk(table.Add(Spec(1, 10, {}, 1, 0), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(2, 20, {}, 1, 0), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 30, {}, 2, 0), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(4, 40, {}, 3, 1), 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(5, 50, {}, 1, 0), 0)));
  const Scope gpu0 = GpuScope(0);
  const Scope gpu1 = GpuScope(1);
  const Scope s1 = SessionScope(0, 1);
  const Scope s2 = SessionScope(0, 2);
  EXPECT_THAT(Ids(table, table.Candidates(gpu0)), ElementsAre(1, 2, 3, 5));
  EXPECT_EQ(table.CandidateBytes(gpu0), 110);
  EXPECT_THAT(Ids(table, table.Candidates(s1)), ElementsAre(1, 2, 5));
  EXPECT_EQ(table.CandidateBytes(s1), 80);
  EXPECT_THAT(Ids(table, table.Candidates(s2)), ElementsAre(3));
  EXPECT_THAT(Ids(table, table.Candidates(gpu1)), ElementsAre(4));
  EXPECT_EQ(table.CandidateBytes(gpu1), 40);
  EXPECT_THAT(table.Candidates(GpuScope(7)), IsEmpty());
  EXPECT_EQ(table.CandidateBytes(GpuScope(7)), 0);
  EXPECT_THAT(table.Candidates(SessionScope(0, 99)), IsEmpty());
  EXPECT_EQ(table.CandidateBytes(SessionScope(0, 99)), 0);

  // Remove from the front, the middle and the back of the lists.
  ASSERT_TRUE(IsOk(table.SetState(1, S::kEvicted)));
  ASSERT_TRUE(IsOk(table.SetState(3, S::kOffloading)));
  ASSERT_TRUE(IsOk(table.SetState(5, S::kOffloading)));
  ASSERT_TRUE(IsOk(table.SetState(5, S::kOffloaded)));
  EXPECT_THAT(Ids(table, table.Candidates(gpu0)), ElementsAre(2));
  EXPECT_EQ(table.CandidateBytes(gpu0), 20);
  EXPECT_THAT(Ids(table, table.Candidates(s1)), ElementsAre(2));
  EXPECT_EQ(table.CandidateBytes(s1), 20);
  EXPECT_THAT(table.Candidates(s2), IsEmpty());
  EXPECT_EQ(table.CandidateBytes(s2), 0);
  EXPECT_TRUE(
      StatsAre(table.ScopeStats(s1),
               {.device = 20, .host = 50, .evicted = 10, .tensors = 3}));
  EXPECT_TRUE(
      StatsAre(table.ScopeStats(s2),
               {.device = 30, .releasing = 30, .host = 30, .tensors = 1}));
  EXPECT_EQ(table.ScopeStats(s2).committed_bytes(), 0);
  EXPECT_TRUE(StatsAre(table.ScopeStats(gpu0), {.device = 50,
                                                .releasing = 30,
                                                .host = 80,
                                                .evicted = 10,
                                                .tensors = 4}));
  EXPECT_TRUE(StatsAre(table.ScopeStats(gpu1), {.device = 40, .tensors = 1}));

  ASSERT_TRUE(IsOk(table.CancelRelease(3)));
  ASSERT_TRUE(IsOk(table.SetState(5, S::kReloading)));
  ASSERT_TRUE(IsOk(table.SetState(5, S::kResident)));
  ASSERT_TRUE(IsOk(table.MarkRecomputed(1, 0)));
  ASSERT_TRUE(IsOk(table.Free(2)));
  EXPECT_THAT(Ids(table, table.Candidates(gpu0)), ElementsAre(1, 3, 5));
  EXPECT_EQ(table.CandidateBytes(gpu0), 90);
  EXPECT_THAT(Ids(table, table.Candidates(s1)), ElementsAre(1, 5));
  EXPECT_EQ(table.CandidateBytes(s1), 60);
  EXPECT_THAT(Ids(table, table.Candidates(s2)), ElementsAre(3));
  EXPECT_TRUE(StatsAre(table.ScopeStats(gpu0), {.device = 90, .tensors = 3}));
  // Every listed slot is resident and in the scope.
  for (uint32_t slot : table.Candidates(gpu0)) {
    EXPECT_EQ(table.AtSlot(slot).state, S::kResident);
    EXPECT_EQ(table.AtSlot(slot).gpu, 0);
  }
}

TEST(TensorTable, FindByKeyReturnsCurrentTensorOfSession) {
  TensorTable table;
  TensorSpec a = Spec(1, 100, {}, 1);
  a.stable_key = 5;
  TensorSpec b = Spec(2, 100, {}, 2);
  b.stable_key = 5;
  ASSERT_TRUE(IsOk(table.Add(a, 0)));
  ASSERT_TRUE(IsOk(table.Add(b, 0)));
  ASSERT_TRUE(IsOk(table.Add(Spec(3, 100, {}, 1), 0)));  // no key
  ASSERT_NE(table.FindByKey(1, 5), nullptr);
  EXPECT_EQ(table.FindByKey(1, 5)->id, 1u);
  ASSERT_NE(table.FindByKey(2, 5), nullptr);
  EXPECT_EQ(table.FindByKey(2, 5)->id, 2u);
  EXPECT_EQ(table.FindByKey(1, 6), nullptr);
  EXPECT_EQ(table.FindByKey(3, 5), nullptr);
  EXPECT_EQ(table.FindByKey(1, 0), nullptr);  // 0 means "no key"

  // The next iteration's tensor with the same key takes over.
  TensorSpec a2 = Spec(11, 100, {}, 1);
  a2.stable_key = 5;
  ASSERT_TRUE(IsOk(table.Free(1)));
  EXPECT_EQ(table.FindByKey(1, 5), nullptr);
  ASSERT_TRUE(IsOk(table.Add(a2, 0)));
  ASSERT_NE(table.FindByKey(1, 5), nullptr);
  EXPECT_EQ(table.FindByKey(1, 5)->id, 11u);
  // Its state is visible through the key.
  ASSERT_TRUE(IsOk(table.SetState(11, S::kOffloading)));
  EXPECT_EQ(table.FindByKey(1, 5)->state, S::kOffloading);
  // Retiring it leaves the other session's tensor with that key alone.
  ASSERT_TRUE(IsOk(table.Free(11)));
  EXPECT_EQ(table.FindByKey(1, 5), nullptr);
  EXPECT_EQ(table.FindByKey(2, 5)->id, 2u);
}

TEST(TensorTable, FindByKeyIgnoresRetiredHolderWhenNewerTensorHasKey) {
  TensorTable table;
  TensorSpec old_spec = Spec(1, 100, {}, 1);
  old_spec.stable_key = 8;
  TensorSpec new_spec = Spec(2, 100, {}, 1);
  new_spec.stable_key = 8;
  ASSERT_TRUE(IsOk(table.Add(old_spec, 0)));
  ASSERT_TRUE(IsOk(table.Add(new_spec, 0)));
  EXPECT_EQ(table.FindByKey(1, 8)->id, 2u);
  // Retiring the superseded tensor must not drop the newer one's entry.
  ASSERT_TRUE(IsOk(table.Free(1)));
  ASSERT_NE(table.FindByKey(1, 8), nullptr);
  EXPECT_EQ(table.FindByKey(1, 8)->id, 2u);
}

TEST(TensorTable, SetAdjacentFreeBytesStoresValueAndRejectsNegative) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));
  ASSERT_TRUE(IsOk(table.SetAdjacentFreeBytes(1, 4096)));
  EXPECT_EQ(table.Find(1)->adjacent_free_bytes, 4096);
  EXPECT_TRUE(IsError(table.SetAdjacentFreeBytes(1, -1),
                      absl::StatusCode::kInvalidArgument,
                      {"tensor 1", "negative adjacent free bytes"}));
  EXPECT_EQ(table.Find(1)->adjacent_free_bytes, 4096);
}

TEST(TensorTable, TensorStateNamesAreDistinct) {
  EXPECT_EQ(TensorStateName(S::kResident), "resident");
  EXPECT_EQ(TensorStateName(S::kOffloading), "offloading");
  EXPECT_EQ(TensorStateName(S::kOffloaded), "offloaded");
  EXPECT_EQ(TensorStateName(S::kReloading), "reloading");
  EXPECT_EQ(TensorStateName(S::kEvicted), "evicted");
  EXPECT_EQ(TensorStateName(S::kFreed), "freed");
}

TEST(TensorTable, SessionIsBoundToTheGpuOfItsFirstTensor) {
  TensorTable table;
  ASSERT_TRUE(IsOk(table.Add(Spec(1), 0)));  // session 1 on GPU 0
  TensorSpec other = Spec(2);
  other.gpu = 1;
  const absl::Status s = table.Add(other, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), testing::HasSubstr("bound to GPU 0"));
  EXPECT_FALSE(table.Contains(2));
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

TEST(TensorTable, AddBatchRejectsOneSessionOnTwoGpus) {
  TensorTable table;
  TensorSpec a = Spec(1);
  a.session = 9;
  TensorSpec b = Spec(2);
  b.session = 9;
  b.gpu = 3;
  const absl::Status s = table.AddBatch({a, b}, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(table.Contains(1));
  EXPECT_FALSE(table.Contains(2));
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

}  // namespace
}  // namespace deltad::policy
