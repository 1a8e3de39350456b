#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/evicted_components.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/status_assertions.h"

// The evicted components as TensorTable keeps them through evictions,
// recomputations, frees and retirements.
namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using testing_util::IsOk;
using S = TensorState;

class TableComponents : public testing::Test {
 protected:
  // Adds `id` with compute cost `cost`, 1 byte, session 1, GPU 0.
  void Add(TensorId id, int64_t cost, std::vector<TensorId> parents = {}) {
    TensorSpec s;
    s.id = id;
    s.session = 1;
    s.bytes = 1;
    s.compute_cost_ns = cost;
    s.parents = std::move(parents);
    ASSERT_TRUE(IsOk(table_.Add(s, 0)));
  }
  void Evict(TensorId id) {
    ASSERT_TRUE(IsOk(table_.SetState(id, S::kEvicted)));
  }
  void Recompute(TensorId id) {
    ASSERT_TRUE(IsOk(table_.MarkRecomputed(id, 0)));
  }
  uint32_t Slot(TensorId id) const {
    const uint32_t s = table_.SlotOf(id);
    EXPECT_NE(s, UINT32_MAX) << "tensor " << id;
    return s;
  }
  bool Member(TensorId id) const {
    return table_.components().Contains(Slot(id));
  }
  uint32_t Root(TensorId id) const {
    EXPECT_TRUE(Member(id)) << "tensor " << id;
    return table_.components().ComponentOf(Slot(id));
  }
  int64_t ComponentCost(TensorId id) const {
    return table_.components().Cost(Root(id));
  }
  std::vector<TensorId> ComponentIds(TensorId id) const {
    std::vector<TensorId> ids;
    for (uint32_t s : table_.components().Members(Root(id))) {
      ids.push_back(table_.AtSlot(s).id);
    }
    std::sort(ids.begin(), ids.end());
    return ids;
  }
  int64_t RecomputeCost(TensorId id) const {
    return RecomputeNs(table_, Slot(id));
  }
  int64_t EqCost(TensorId id) const {
    return NeighbourhoodNsEq(table_, Slot(id));
  }
  int64_t ExactCost(TensorId id) const {
    return NeighbourhoodNsExact(table_, Slot(id));
  }

  TensorTable table_;
};

TEST_F(TableComponents, ChainComponentsFollowEvictAndRecompute) {
  // 1 -> 2 -> 3 -> 4 -> 5
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  Add(4, 1000, {3});
  Add(5, 10000, {4});
  EXPECT_EQ(table_.components().size(), 0u);
  EXPECT_EQ(RecomputeCost(3), 100);

  Evict(2);
  EXPECT_EQ(ComponentCost(2), 10);
  EXPECT_EQ(RecomputeCost(3), 110);
  EXPECT_EQ(RecomputeCost(1), 1);
  EXPECT_EQ(EqCost(1), 11);
  EXPECT_EQ(EqCost(3), 110);

  Evict(3);
  EXPECT_EQ(Root(2), Root(3));
  EXPECT_EQ(ComponentCost(3), 110);
  EXPECT_EQ(RecomputeCost(4), 1110);
  EXPECT_EQ(EqCost(1), 111);

  Evict(1);
  EXPECT_THAT(ComponentIds(1), ElementsAre(1, 2, 3));
  EXPECT_EQ(RecomputeCost(4), 1111);
  EXPECT_EQ(table_.components().size(), 3u);

  // Rebuilding the middle splits the chain in two.
  Recompute(2);
  EXPECT_FALSE(Member(2));
  EXPECT_NE(Root(1), Root(3));
  EXPECT_THAT(ComponentIds(1), ElementsAre(1));
  EXPECT_THAT(ComponentIds(3), ElementsAre(3));
  EXPECT_EQ(ComponentCost(1), 1);
  EXPECT_EQ(ComponentCost(3), 100);
  EXPECT_EQ(RecomputeCost(2), 11);
  EXPECT_EQ(RecomputeCost(4), 1100);
  EXPECT_EQ(EqCost(2), 111);
  EXPECT_EQ(ExactCost(2), 111);

  Recompute(1);
  EXPECT_EQ(table_.components().size(), 1u);
  EXPECT_EQ(RecomputeCost(2), 10);

  Evict(4);
  EXPECT_THAT(ComponentIds(4), ElementsAre(3, 4));
  EXPECT_EQ(RecomputeCost(5), 11100);
  EXPECT_EQ(EqCost(2), 1110);
  EXPECT_EQ(ExactCost(2), 1110);

  Recompute(3);
  EXPECT_THAT(ComponentIds(4), ElementsAre(4));
  EXPECT_EQ(RecomputeCost(5), 11000);
  EXPECT_EQ(RecomputeCost(3), 100);
  EXPECT_EQ(EqCost(3), 1100);
}

TEST_F(TableComponents, DiamondComponentsCountSharedAncestorsOnce) {
  // 1 -> {2, 3} -> 4 -> 5
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {1});
  Add(4, 1000, {2, 3});
  Add(5, 10000, {4});

  Evict(2);
  Evict(3);
  EXPECT_NE(Root(2), Root(3));  // 1 is resident: not connected
  EXPECT_EQ(RecomputeCost(4), 1110);
  EXPECT_EQ(EqCost(1), 111);

  Evict(1);
  EXPECT_EQ(Root(2), Root(3));
  EXPECT_EQ(ComponentCost(1), 111);
  // Both parents of 4 are in one component: counted once.
  EXPECT_EQ(RecomputeCost(4), 1111);
  EXPECT_EQ(ExactCost(4), 1111);

  Evict(4);
  EXPECT_THAT(ComponentIds(4), ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(RecomputeCost(5), 11111);

  // Without 1 the rest still hangs together through 4.
  Recompute(1);
  EXPECT_THAT(ComponentIds(2), ElementsAre(2, 3, 4));
  EXPECT_EQ(ComponentCost(3), 1110);
  EXPECT_EQ(RecomputeCost(5), 11110);
  EXPECT_EQ(EqCost(1), 1111);

  // Without 4 as well, 2 and 3 fall apart.
  Recompute(4);
  EXPECT_NE(Root(2), Root(3));
  EXPECT_EQ(ComponentCost(2), 10);
  EXPECT_EQ(ComponentCost(3), 100);
  EXPECT_EQ(RecomputeCost(4), 1110);
  EXPECT_EQ(RecomputeCost(5), 10000);
  EXPECT_EQ(table_.components().size(), 2u);
}

// The DTR prototype kept union-find links after a member was recomputed, so
// siblings once joined through their evicted parent stayed joined.
TEST_F(TableComponents, RecomputingSharedParentSplitsItsEvictedChildren) {
  // a -> b -> d, a -> c -> e
  const TensorId a = 1, b = 2, c = 3, d = 4, e = 5;
  Add(a, 1);
  Add(b, 10, {a});
  Add(c, 100, {a});
  Add(d, 1000, {b});
  Add(e, 10000, {c});
  Evict(b);
  Evict(a);
  Evict(c);
  ASSERT_THAT(ComponentIds(a), ElementsAre(a, b, c));
  ASSERT_EQ(ComponentCost(b), 111);
  ASSERT_EQ(RecomputeCost(d), 1111);
  ASSERT_EQ(RecomputeCost(e), 10111);

  Recompute(a);
  EXPECT_EQ(table_.components().size(), 2u);
  EXPECT_NE(Root(b), Root(c));
  EXPECT_THAT(ComponentIds(b), ElementsAre(b));
  EXPECT_THAT(ComponentIds(c), ElementsAre(c));
  EXPECT_EQ(ComponentCost(b), 10);
  EXPECT_EQ(ComponentCost(c), 100);
  EXPECT_EQ(RecomputeCost(d), 1000 + 10);
  EXPECT_EQ(RecomputeCost(e), 10000 + 100);
  EXPECT_EQ(RecomputeCost(a), 1);
  EXPECT_EQ(EqCost(a), 111);
  EXPECT_EQ(EqCost(d), 1010);
  EXPECT_EQ(ExactCost(d), 1010);

  // Evicting a again joins them again; cancelling that splits them again.
  Evict(a);
  EXPECT_EQ(Root(b), Root(c));
  EXPECT_EQ(RecomputeCost(d), 1111);
  ASSERT_TRUE(IsOk(table_.CancelRelease(a)));
  EXPECT_NE(Root(b), Root(c));
  EXPECT_EQ(RecomputeCost(d), 1010);
  EXPECT_EQ(RecomputeCost(e), 10100);
}

TEST_F(TableComponents, FreedTensorIsMemberUntilRetired) {
  // 1 -> 2 -> 3
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  ASSERT_TRUE(IsOk(table_.Free(1)));  // 2 still needs it
  EXPECT_TRUE(Member(1));
  EXPECT_EQ(RecomputeCost(2), 11);
  Evict(2);
  EXPECT_THAT(ComponentIds(2), ElementsAre(1, 2));
  EXPECT_EQ(RecomputeCost(3), 111);
  Recompute(2);
  EXPECT_THAT(ComponentIds(1), ElementsAre(1));
  EXPECT_EQ(RecomputeCost(3), 100);
  ASSERT_TRUE(IsOk(table_.Free(2)));  // freed, kept for 3: joins 1
  EXPECT_THAT(ComponentIds(2), ElementsAre(1, 2));
  EXPECT_EQ(RecomputeCost(3), 111);
  ASSERT_TRUE(IsOk(table_.Free(3)));
  EXPECT_EQ(table_.components().size(), 0u);
  EXPECT_EQ(table_.size(), 0u);
}

TEST_F(TableComponents, RetiringFreedChildSplitsItsComponent) {
  // 1 -> 2 -> 3 with 1 evicted, 2 freed (kept for 3), then 4 hangs off 1.
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  Add(4, 1000, {1});
  Add(5, 10000, {4});
  Evict(1);
  Evict(4);
  ASSERT_TRUE(IsOk(table_.Free(2)));
  EXPECT_THAT(ComponentIds(1), ElementsAre(1, 2, 4));
  EXPECT_EQ(RecomputeCost(3), 1111);
  EXPECT_EQ(RecomputeCost(5), 11011);
  // 3 goes, 2 is retired with it: 1 and 4 remain one component.
  ASSERT_TRUE(IsOk(table_.Free(3)));
  EXPECT_EQ(table_.Find(2), nullptr);
  EXPECT_THAT(ComponentIds(1), ElementsAre(1, 4));
  EXPECT_EQ(RecomputeCost(5), 11001);
  EXPECT_EQ(table_.components().size(), 2u);
}

TEST_F(TableComponents, OffloadedTensorSeparatesComponents) {
  // 1 -> 2 -> 3 -> 4
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  Add(4, 1000, {3});
  Evict(1);
  ASSERT_TRUE(IsOk(table_.SetState(2, S::kOffloading)));
  ASSERT_TRUE(IsOk(table_.SetState(2, S::kOffloaded)));
  Evict(3);
  EXPECT_FALSE(Member(2));
  EXPECT_NE(Root(1), Root(3));
  EXPECT_EQ(RecomputeCost(4), 1100);
  // The offloaded tensor's own rebuild needs only its evicted ancestors.
  EXPECT_EQ(RecomputeCost(2), 11);
  EXPECT_EQ(EqCost(2), 111);
  EXPECT_EQ(ExactCost(2), 111);
  // Dropping its host copy makes it part of one component with both.
  Evict(2);
  EXPECT_THAT(ComponentIds(2), ElementsAre(1, 2, 3));
  EXPECT_EQ(RecomputeCost(4), 1111);
}

TEST_F(TableComponents, CancelledEvictionLeavesComponent) {
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  Evict(1);
  Evict(2);
  ASSERT_EQ(ComponentCost(1), 11);
  ASSERT_TRUE(IsOk(table_.CancelRelease(1)));
  EXPECT_FALSE(Member(1));
  EXPECT_THAT(ComponentIds(2), ElementsAre(2));
  EXPECT_EQ(RecomputeCost(3), 110);
  EXPECT_EQ(table_.Find(1)->recompute_count, 0u);
}

TEST_F(TableComponents, NewChildOfEvictedParentIsNotMember) {
  Add(1, 1);
  Evict(1);
  Add(2, 10, {1});
  EXPECT_FALSE(Member(2));
  EXPECT_EQ(RecomputeCost(2), 11);
  Evict(2);
  EXPECT_THAT(ComponentIds(2), ElementsAre(1, 2));
}

// A mirror table defers its components; every read sees what a table that
// keeps them sees: the same members with the same costs, through a hub
// (a tensor with many parents, as an optimizer step's, whose leaving leaves
// the components stale until read) leaving and rejoining, recomputes and
// the end of the deferral.
TEST(TableComponentsDeferred, ReadTheSameAsKeptOnes) {
  TensorTable kept;
  TensorTable deferred;
  deferred.DeferComponents(true);
  auto both = [&](auto change) {
    change(kept);
    change(deferred);
  };
  auto add = [&](TensorId id, std::vector<TensorId> parents) {
    both([&](TensorTable& t) {
      TensorSpec s;
      s.id = id;
      s.session = 1;
      s.bytes = 1;
      s.compute_cost_ns = static_cast<int64_t>(id);
      s.parents = parents;
      ASSERT_TRUE(IsOk(t.Add(s, 0)));
    });
  };
  auto set = [&](TensorId id, TensorState to) {
    both([&](TensorTable& t) { ASSERT_TRUE(IsOk(t.SetState(id, to))); });
  };
  auto recompute = [&](TensorId id) {
    both([&](TensorTable& t) { ASSERT_TRUE(IsOk(t.MarkRecomputed(id, 0))); });
  };
  // What each live tensor's component holds, as (member ids, cost).
  auto view = [](const TensorTable& t, const std::vector<TensorId>& ids) {
    std::vector<std::pair<std::vector<TensorId>, int64_t>> out;
    for (TensorId id : ids) {
      const uint32_t slot = t.SlotOf(id);
      if (slot == UINT32_MAX || !t.components().Contains(slot)) {
        out.push_back({{}, -1});
        continue;
      }
      const uint32_t c = t.components().ComponentOf(slot);
      std::vector<TensorId> members;
      for (uint32_t m : t.components().Members(c)) {
        members.push_back(t.AtSlot(m).id);
      }
      std::sort(members.begin(), members.end());
      out.push_back({members, t.components().Cost(c)});
    }
    return out;
  };
  std::vector<TensorId> ids;
  // Parameters 1-20, a chain 21-40 over them, a hub 41 over all of them.
  for (TensorId id = 1; id <= 20; ++id) add(id, {}), ids.push_back(id);
  for (TensorId id = 21; id <= 40; ++id) {
    add(id, {id - 20, id == 21 ? TensorId{1} : id - 1});
    ids.push_back(id);
  }
  std::vector<TensorId> all(ids);
  add(41, all);
  ids.push_back(41);
  auto expect_same = [&](const char* when) {
    EXPECT_EQ(view(deferred, ids), view(kept, ids)) << when;
  };
  for (TensorId id = 21; id <= 41; id += 2) set(id, TensorState::kEvicted);
  expect_same("odd ones evicted");
  for (TensorId id = 22; id <= 40; id += 2) set(id, TensorState::kEvicted);
  expect_same("all evicted: one component through the hub");
  auto cost_of = [&](TensorId id) { return view(kept, {id})[0].second; };
  EXPECT_EQ(cost_of(21), 651);  // 21 + ... + 41
  recompute(41);  // the hub leaves: the components are rebuilt when read
  expect_same("hub recomputed");
  EXPECT_EQ(cost_of(21), 610);  // the chain holds the rest together
  recompute(30);
  recompute(25);
  expect_same("chain cut twice");
  EXPECT_EQ(cost_of(21), 21 + 22 + 23 + 24);
  EXPECT_EQ(cost_of(27), 26 + 27 + 28 + 29);
  EXPECT_EQ(cost_of(40), 355);  // 31 + ... + 40
  set(41, TensorState::kEvicted);
  expect_same("hub evicted again");
  deferred.DeferComponents(false);
  recompute(41);
  recompute(35);
  expect_same("kept again after the deferral");
}

}  // namespace
}  // namespace deltad::policy
