#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/status_assertions.h"
#include "tests/unit/policies/tensor_table_test_helpers.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testing_util::GpuScope;
using testing_util::Ids;
using testing_util::IsError;
using testing_util::IsOk;
using testing_util::SessionScope;
using testing_util::Spec;
using testing_util::StatsAre;
using S = TensorState;

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

// The Filter bounds a sample from its list entry alone: every entry must
// equal its tensor's fields after adds, touches, recomputes and the swaps
// that removals make in the lists.
TEST(TensorTable, CandidateEntriesMirrorTheirTensorsFields) {
  TensorTable table;
  for (TensorId id = 1; id <= 6; ++id) {
    TensorSpec s = Spec(id, 10 * static_cast<int64_t>(id), {}, 1 + id % 2);
    s.compute_cost_ns = 7 * static_cast<int64_t>(id);
    s.flags.offload_pinned = id == 4;
    ASSERT_TRUE(IsOk(table.Add(s, static_cast<int64_t>(id))));
  }
  ASSERT_TRUE(IsOk(table.Touch(2, 100)));
  ASSERT_TRUE(IsOk(table.SetState(1, S::kEvicted)));  // swaps the last in
  ASSERT_TRUE(IsOk(table.Touch(6, 200)));
  ASSERT_TRUE(IsOk(table.MarkRecomputed(1, 300)));
  ASSERT_TRUE(IsOk(table.Free(3)));
  ASSERT_TRUE(IsOk(table.Touch(1, 400)));
  for (const Scope& scope :
       {GpuScope(0), SessionScope(0, 1), SessionScope(0, 2)}) {
    for (const CandidateEntry& e : table.CandidateEntries(scope)) {
      const Tensor& t = table.AtSlot(e.slot);
      EXPECT_EQ(e.bytes, t.bytes) << t.id;
      EXPECT_EQ(e.last_access_ns, t.last_access_ns) << t.id;
      EXPECT_EQ(e.compute_cost_ns, t.compute_cost_ns) << t.id;
      EXPECT_EQ(e.flags.offload_pinned, t.flags.offload_pinned) << t.id;
    }
  }
  EXPECT_EQ(table.Find(1)->last_access_ns, 400);
  EXPECT_THAT(Ids(table, table.Candidates(GpuScope(0))),
              ::testing::UnorderedElementsAre(1, 2, 4, 5, 6));
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

}  // namespace
}  // namespace deltad::policy
