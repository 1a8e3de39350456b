#include "policies/tensor_table.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/tensor.h"
#include "tests/unit/policies/status_assertions.h"
#include "tests/unit/policies/tensor_table_test_helpers.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testing_util::Expected;
using testing_util::GpuScope;
using testing_util::Ids;
using testing_util::IsError;
using testing_util::IsOk;
using testing_util::SessionScope;
using testing_util::Spec;
using testing_util::StateOf;
using testing_util::StatsAre;
using S = TensorState;

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

}  // namespace
}  // namespace deltad::policy
