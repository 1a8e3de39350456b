#include "policies/evicted_components.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/legal_transitions.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;
using S = TensorState;

testing::AssertionResult IsOk(const absl::Status& s) {
  if (s.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << s.ToString();
}

// An undirected adjacency standing in for the table's parents and children.
class Adjacency {
 public:
  void Edge(uint32_t a, uint32_t b) {
    adj_[a].push_back(b);
    adj_[b].push_back(a);
  }
  void Erase(EvictedComponents& uf, uint32_t slot) const {
    uf.Erase(slot, [this](uint32_t s, absl::FunctionRef<void(uint32_t)> visit) {
      auto it = adj_.find(s);
      if (it == adj_.end()) return;
      for (uint32_t n : it->second) visit(n);
    });
  }

 private:
  std::map<uint32_t, std::vector<uint32_t>> adj_;
};

// --- EvictedComponents on its own
// ---------------------------------------------

TEST(EvictedComponents, InsertMakesSingletonWithOwnCost) {
  EvictedComponents uf;
  EXPECT_EQ(uf.size(), 0u);
  EXPECT_FALSE(uf.Contains(3));
  uf.Insert(3, 70);
  EXPECT_TRUE(uf.Contains(3));
  EXPECT_FALSE(uf.Contains(2));
  EXPECT_FALSE(uf.Contains(4));
  EXPECT_FALSE(uf.Contains(100000));
  EXPECT_EQ(uf.Cost(uf.ComponentOf(3)), 70);
  EXPECT_THAT(uf.Members(uf.ComponentOf(3)), ElementsAre(3u));
  EXPECT_EQ(uf.size(), 1u);
}

TEST(EvictedComponents, InsertOfMemberChangesNothing) {
  EvictedComponents uf;
  uf.Insert(1, 10);
  uf.Insert(2, 20);
  uf.Union(1, 2);
  uf.Insert(2, 999);
  EXPECT_EQ(uf.size(), 2u);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(2)), 30);
  EXPECT_EQ(uf.ComponentOf(1), uf.ComponentOf(2));
}

TEST(EvictedComponents, UnionSumsCostsAndMembers) {
  EvictedComponents uf;
  uf.Insert(0, 1);
  uf.Insert(5, 10);
  uf.Insert(9, 100);
  uf.Union(0, 5);
  EXPECT_EQ(uf.ComponentOf(0), uf.ComponentOf(5));
  EXPECT_NE(uf.ComponentOf(0), uf.ComponentOf(9));
  EXPECT_EQ(uf.Cost(uf.ComponentOf(0)), 11);
  EXPECT_THAT(uf.Members(uf.ComponentOf(5)), UnorderedElementsAre(0u, 5u));
  uf.Union(9, 5);
  const uint32_t root = uf.ComponentOf(9);
  EXPECT_EQ(uf.ComponentOf(0), root);
  EXPECT_EQ(uf.Cost(root), 111);
  EXPECT_THAT(uf.Members(root), UnorderedElementsAre(0u, 5u, 9u));
  EXPECT_EQ(uf.size(), 3u);
}

TEST(EvictedComponents, UnionWithinOneComponentDoesNotCountTwice) {
  EvictedComponents uf;
  uf.Insert(1, 10);
  uf.Insert(2, 20);
  uf.Insert(3, 30);
  uf.Union(1, 2);
  uf.Union(2, 3);
  uf.Union(3, 1);
  uf.Union(1, 1);
  const uint32_t root = uf.ComponentOf(1);
  EXPECT_EQ(uf.Cost(root), 60);
  EXPECT_EQ(uf.Members(root).size(), 3u);
}

TEST(EvictedComponents, EraseSplitsChainAtErasedMember) {
  EvictedComponents uf;
  Adjacency adj;  // 0 - 1 - 2
  adj.Edge(0, 1);
  adj.Edge(1, 2);
  uf.Insert(0, 1);
  uf.Insert(1, 10);
  uf.Insert(2, 100);
  uf.Union(0, 1);
  uf.Union(1, 2);
  ASSERT_EQ(uf.Cost(uf.ComponentOf(0)), 111);

  adj.Erase(uf, 1);
  EXPECT_FALSE(uf.Contains(1));
  EXPECT_EQ(uf.size(), 2u);
  EXPECT_NE(uf.ComponentOf(0), uf.ComponentOf(2));
  EXPECT_EQ(uf.Cost(uf.ComponentOf(0)), 1);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(2)), 100);
  EXPECT_THAT(uf.Members(uf.ComponentOf(0)), ElementsAre(0u));
  EXPECT_THAT(uf.Members(uf.ComponentOf(2)), ElementsAre(2u));
}

TEST(EvictedComponents, EraseOfRootKeepsOthersJoinedThroughRemainingPath) {
  EvictedComponents uf;
  Adjacency adj;  // a cycle 0 - 1 - 2 - 3 - 0
  adj.Edge(0, 1);
  adj.Edge(1, 2);
  adj.Edge(2, 3);
  adj.Edge(3, 0);
  for (uint32_t s = 0; s < 4; ++s) uf.Insert(s, int64_t{1} << s);
  uf.Union(0, 1);
  uf.Union(1, 2);
  uf.Union(2, 3);
  // Slot 0 has two neighbours inside: its removal takes the re-forming path,
  // and the ring stays one component (1 - 2 - 3).
  adj.Erase(uf, 0);
  EXPECT_FALSE(uf.Contains(0));
  EXPECT_EQ(uf.size(), 3u);
  std::set<uint32_t> roots;
  for (uint32_t s = 1; s < 4; ++s) roots.insert(uf.ComponentOf(s));
  EXPECT_EQ(roots.size(), 1u);
  EXPECT_EQ(uf.Cost(*roots.begin()), 15 - 1);
  EXPECT_EQ(uf.Members(*roots.begin()).size(), 3u);
}

TEST(EvictedComponents, EraseOfAHubLeavesOneComponentPerBranch) {
  EvictedComponents uf;
  Adjacency adj;  // hub 0 with branches 1, 2 - 3, 4 - 5 - 6; 7 joins 1 and 2
  for (auto [a, b] : std::vector<std::pair<uint32_t, uint32_t>>{
           {0, 1}, {0, 2}, {2, 3}, {0, 4}, {4, 5}, {5, 6}}) {
    adj.Edge(a, b);
  }
  for (uint32_t s = 0; s < 7; ++s) uf.Insert(s, int64_t{1} << s);
  for (uint32_t s : {1, 2, 4}) uf.Union(0, s);
  uf.Union(2, 3);
  uf.Union(4, 5);
  uf.Union(5, 6);
  adj.Erase(uf, 0);
  EXPECT_EQ(uf.size(), 6u);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(1)), 2);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(3)), 4 + 8);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(6)), 16 + 32 + 64);
  EXPECT_THAT(uf.Members(uf.ComponentOf(2)), UnorderedElementsAre(2u, 3u));
  EXPECT_THAT(uf.Members(uf.ComponentOf(5)), UnorderedElementsAre(4u, 5u, 6u));
  const std::set<uint32_t> ids = {uf.ComponentOf(1), uf.ComponentOf(2),
                                  uf.ComponentOf(4)};
  EXPECT_EQ(ids.size(), 3u);

  // Two branches joined again beside the hub stay one component.
  EvictedComponents joined;
  adj.Edge(1, 7);
  adj.Edge(7, 2);
  for (uint32_t s = 0; s < 8; ++s) joined.Insert(s, 1);
  for (uint32_t s : {1, 2, 4}) joined.Union(0, s);
  for (auto [a, b] : std::vector<std::pair<uint32_t, uint32_t>>{
           {2, 3}, {4, 5}, {5, 6}, {1, 7}, {7, 2}}) {
    joined.Union(a, b);
  }
  adj.Erase(joined, 0);
  EXPECT_EQ(joined.ComponentOf(1), joined.ComponentOf(3));
  EXPECT_EQ(joined.Cost(joined.ComponentOf(1)), 4);
  EXPECT_EQ(joined.Cost(joined.ComponentOf(6)), 3);
}

TEST(EvictedComponents, EraseOfAHubOfManyBranchesLeavesOneComponentEach) {
  // Hub 0 with 40 branches of two members (2i+1 - 2i+2), every other one
  // joined to the next beside the hub: 20 components once it is gone.
  EvictedComponents uf;
  Adjacency adj;
  constexpr uint32_t kBranches = 40;
  uf.Insert(0, 1);
  for (uint32_t i = 0; i < kBranches; ++i) {
    const uint32_t a = 2 * i + 1;
    const uint32_t b = 2 * i + 2;
    adj.Edge(0, a);
    adj.Edge(a, b);
    uf.Insert(a, 10);
    uf.Insert(b, 100);
    uf.Union(0, a);
    uf.Union(a, b);
    if (i % 2 == 1) {
      adj.Edge(b, b - 2);
      uf.Union(b, b - 2);
    }
  }
  adj.Erase(uf, 0);
  EXPECT_EQ(uf.size(), 2 * kBranches);
  std::set<uint32_t> ids;
  for (uint32_t i = 0; i < kBranches; i += 2) {
    const uint32_t c = uf.ComponentOf(2 * i + 1);
    ids.insert(c);
    EXPECT_EQ(uf.ComponentOf(2 * i + 4), c);
    EXPECT_EQ(uf.Cost(c), 220);
    EXPECT_EQ(uf.Members(c).size(), 4u);
  }
  EXPECT_EQ(ids.size(), kBranches / 2);
}

// Cutting a long chain near one end looks at the short part, not the whole
// chain: a run that recomputes along a chain would otherwise take time
// quadratic in its length.
TEST(EvictedComponents, CuttingALongChainVisitsAboutTheShortPart) {
  constexpr uint32_t kLength = 10000;
  EvictedComponents uf;
  std::vector<std::vector<uint32_t>> adj(kLength);
  for (uint32_t s = 0; s < kLength; ++s) {
    uf.Insert(s, 1);
    if (s > 0) {
      adj[s].push_back(s - 1);
      adj[s - 1].push_back(s);
      uf.Union(s - 1, s);
    }
  }
  int64_t visited = 0;
  uf.Erase(3, [&](uint32_t s, absl::FunctionRef<void(uint32_t)> visit) {
    ++visited;
    for (uint32_t n : adj[s]) visit(n);
  });
  EXPECT_EQ(uf.Cost(uf.ComponentOf(0)), 3);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(kLength - 1)), kLength - 4);
  EXPECT_LE(visited, 16) << "members' neighbours listed to cut off 3";
}

TEST(EvictedComponents, EraseOfALeafKeepsTheRestTogether) {
  EvictedComponents uf;
  Adjacency adj;  // a chain 0 - 1 - 2 - 3
  adj.Edge(0, 1);
  adj.Edge(1, 2);
  adj.Edge(2, 3);
  for (uint32_t s = 0; s < 4; ++s) uf.Insert(s, int64_t{1} << s);
  uf.Union(0, 1);
  uf.Union(1, 2);
  uf.Union(2, 3);
  // Recompute runs ancestors first: each removal is of the chain's end.
  for (uint32_t s = 0; s < 3; ++s) {
    adj.Erase(uf, s);
    EXPECT_FALSE(uf.Contains(s));
    EXPECT_EQ(uf.ComponentOf(s + 1), uf.ComponentOf(3));
    int64_t expected = 0;
    for (uint32_t k = s + 1; k < 4; ++k) expected += int64_t{1} << k;
    EXPECT_EQ(uf.Cost(uf.ComponentOf(3)), expected);
    EXPECT_EQ(uf.Members(uf.ComponentOf(3)).size(), 3 - s);
  }
}

TEST(EvictedComponents, EraseDoesNotJoinThroughNonMembers) {
  EvictedComponents uf;
  Adjacency adj;  // 0 - 1 - 2 - 7, 7 is not a member; 2 - 3
  adj.Edge(0, 1);
  adj.Edge(1, 2);
  adj.Edge(2, 7);
  adj.Edge(7, 4);
  uf.Insert(0, 1);
  uf.Insert(1, 10);
  uf.Insert(2, 100);
  uf.Insert(4, 1000);
  uf.Union(0, 1);
  uf.Union(1, 2);
  adj.Erase(uf, 0);
  EXPECT_FALSE(uf.Contains(7));
  EXPECT_EQ(uf.ComponentOf(1), uf.ComponentOf(2));
  EXPECT_NE(uf.ComponentOf(2), uf.ComponentOf(4));
  EXPECT_EQ(uf.Cost(uf.ComponentOf(1)), 110);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(4)), 1000);
}

TEST(EvictedComponents, EraseOfNonMemberChangesNothing) {
  EvictedComponents uf;
  Adjacency adj;
  adj.Edge(1, 2);
  uf.Insert(1, 10);
  uf.Insert(2, 20);
  uf.Union(1, 2);
  adj.Erase(uf, 5);
  adj.Erase(uf, 500);
  EXPECT_EQ(uf.size(), 2u);
  EXPECT_EQ(uf.Cost(uf.ComponentOf(1)), 30);
}

TEST(EvictedComponents, EraseOfSingletonAndReinsertTakesNewCost) {
  EvictedComponents uf;
  Adjacency adj;
  uf.Insert(4, 10);
  adj.Erase(uf, 4);
  EXPECT_FALSE(uf.Contains(4));
  EXPECT_EQ(uf.size(), 0u);
  uf.Insert(4, 33);
  EXPECT_TRUE(uf.Contains(4));
  EXPECT_EQ(uf.Cost(uf.ComponentOf(4)), 33);
  EXPECT_THAT(uf.Members(uf.ComponentOf(4)), ElementsAre(4u));
}

// --- Components as the table keeps them
// -------------------------------------------

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

// --- Randomized against a brute-force oracle
// ------------------------------------

// The test's own picture of the table: states, edges and costs by id.
struct ModelNode {
  SessionId session = 0;
  GpuId gpu = 0;
  int64_t bytes = 0;
  int64_t cost = 0;
  bool uncomputable = false;
  S state = S::kResident;
  bool evicted_from_device = false;  // a cancellable eviction
  bool retired = false;
  std::vector<TensorId> parents;
  std::vector<TensorId> children;
};
using Model = std::map<TensorId, ModelNode>;

bool MustBeRebuilt(const ModelNode& n) {
  return !n.retired && (n.state == S::kEvicted || n.state == S::kFreed);
}

// A freed tensor goes once none of its children is left; repeat until stable.
void RetireInModel(Model& m) {
  for (bool changed = true; changed;) {
    changed = false;
    for (auto& [id, n] : m) {
      if (n.retired || n.state != S::kFreed) continue;
      const bool all_gone =
          std::all_of(n.children.begin(), n.children.end(),
                      [&](TensorId c) { return m.at(c).retired; });
      if (all_gone) {
        n.retired = true;
        changed = true;
      }
    }
  }
}

struct Oracle {
  std::map<TensorId, int> component;  // must-be-rebuilt tensors only
  std::vector<int64_t> cost;
  std::vector<size_t> members;
};

// Connected components of the must-be-rebuilt tensors, by flood fill over
// parent and child edges.
Oracle Components(const Model& m) {
  Oracle o;
  for (const auto& [id, n] : m) {
    if (!MustBeRebuilt(n) || o.component.contains(id)) continue;
    const int c = static_cast<int>(o.cost.size());
    o.cost.push_back(0);
    o.members.push_back(0);
    std::vector<TensorId> stack{id};
    o.component[id] = c;
    while (!stack.empty()) {
      const TensorId x = stack.back();
      stack.pop_back();
      const ModelNode& nx = m.at(x);
      o.cost[c] += nx.cost;
      ++o.members[c];
      for (const auto* list : {&nx.parents, &nx.children}) {
        for (TensorId y : *list) {
          if (MustBeRebuilt(m.at(y)) && !o.component.contains(y)) {
            o.component[y] = c;
            stack.push_back(y);
          }
        }
      }
    }
  }
  return o;
}

int64_t OracleAdjacent(const Oracle& o, const ModelNode& n,
                       bool with_children) {
  std::set<int> seen;
  int64_t sum = n.cost;
  auto add = [&](const std::vector<TensorId>& list) {
    for (TensorId y : list) {
      auto it = o.component.find(y);
      if (it == o.component.end()) continue;
      if (seen.insert(it->second).second) sum += o.cost[it->second];
    }
  };
  add(n.parents);
  if (with_children) add(n.children);
  return sum;
}

int64_t OracleExact(const Model& m, const ModelNode& n) {
  std::set<TensorId> region;
  for (bool up : {true, false}) {
    std::vector<TensorId> stack = up ? n.parents : n.children;
    while (!stack.empty()) {
      const TensorId x = stack.back();
      stack.pop_back();
      const ModelNode& nx = m.at(x);
      if (!MustBeRebuilt(nx) || !region.insert(x).second) continue;
      for (TensorId y : up ? nx.parents : nx.children) stack.push_back(y);
    }
  }
  int64_t sum = n.cost;
  for (TensorId x : region) sum += m.at(x).cost;
  return sum;
}

void CheckTable(const TensorTable& table, const Model& m) {
  const Oracle o = Components(m);
  size_t live = 0;
  std::map<int, uint32_t> root_of;  // oracle component -> union-find root
  for (const auto& [id, n] : m) {
    SCOPED_TRACE(absl::StrCat("tensor ", id));
    const Tensor* t = table.Find(id);
    if (n.retired) {
      EXPECT_EQ(t, nullptr);
      continue;
    }
    ++live;
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->state, n.state);
    const uint32_t slot = table.SlotOf(id);
    const EvictedComponents& uf = table.components();
    auto it = o.component.find(id);
    if (it == o.component.end()) {
      EXPECT_FALSE(uf.Contains(slot));
      EXPECT_EQ(RecomputeNs(table, slot), OracleAdjacent(o, n, false));
      EXPECT_EQ(NeighbourhoodNsEq(table, slot), OracleAdjacent(o, n, true));
      EXPECT_EQ(NeighbourhoodNsExact(table, slot), OracleExact(m, n));
      continue;
    }
    ASSERT_TRUE(uf.Contains(slot));
    const uint32_t root = uf.ComponentOf(slot);
    auto [r, fresh] = root_of.emplace(it->second, root);
    EXPECT_EQ(r->second, root) << "one oracle component, two roots";
    if (fresh) {
      EXPECT_EQ(uf.Cost(root), o.cost[it->second]);
      EXPECT_EQ(uf.Members(root).size(), o.members[it->second]);
    }
  }
  EXPECT_EQ(table.size(), live);
  EXPECT_EQ(table.components().size(), o.component.size());
  std::set<uint32_t> roots;
  for (const auto& [c, root] : root_of) roots.insert(root);
  EXPECT_EQ(roots.size(), root_of.size()) << "two oracle components, one root";

  // Bytes and candidate lists, per GPU and per session.
  struct Sum {
    int64_t device = 0, releasing = 0, host = 0, evicted = 0, tensors = 0;
    int64_t candidate_bytes = 0;
    std::vector<TensorId> candidates;
  };
  std::map<GpuId, Sum> by_gpu;
  std::map<SessionId, Sum> by_session;
  for (const auto& [id, n] : m) {
    if (n.retired) continue;
    for (Sum* s : {&by_gpu[n.gpu], &by_session[n.session]}) {
      switch (n.state) {
        case S::kResident:
          s->device += n.bytes;
          s->candidate_bytes += n.bytes;
          s->candidates.push_back(id);
          break;
        case S::kOffloading:
          s->device += n.bytes;
          s->releasing += n.bytes;
          s->host += n.bytes;
          break;
        case S::kOffloaded:
          s->host += n.bytes;
          break;
        case S::kReloading:
          s->device += n.bytes;
          s->host += n.bytes;
          break;
        case S::kEvicted:
          s->evicted += n.bytes;
          break;
        case S::kFreed:
          break;
      }
      if (n.state != S::kFreed) ++s->tensors;
    }
  }
  auto check = [&](const MemoryStats& got, const Scope& scope, const Sum& s) {
    EXPECT_EQ(got.device_bytes, s.device);
    EXPECT_EQ(got.releasing_bytes, s.releasing);
    EXPECT_EQ(got.host_bytes, s.host);
    EXPECT_EQ(got.evicted_bytes, s.evicted);
    EXPECT_EQ(got.tensors, s.tensors);
    std::vector<TensorId> ids;
    for (uint32_t slot : table.Candidates(scope)) {
      ids.push_back(table.AtSlot(slot).id);
    }
    std::sort(ids.begin(), ids.end());
    EXPECT_EQ(ids, s.candidates);
    EXPECT_EQ(table.CandidateBytes(scope), s.candidate_bytes);
  };
  for (const auto& [gpu, s] : by_gpu) {
    SCOPED_TRACE(absl::StrCat("gpu ", gpu));
    Scope scope;
    scope.gpu = gpu;
    check(table.GpuStats(gpu), scope, s);
  }
  for (const auto& [session, s] : by_session) {
    SCOPED_TRACE(absl::StrCat("session ", session));
    Scope scope;
    scope.session = session;
    check(table.SessionStats(session), scope, s);
  }
}

void RunRandomSequence(uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  TensorTable table;
  Model m;
  TensorId next_id = 1;
  auto live_ids = [&](bool freed_too) {
    std::vector<TensorId> ids;
    for (const auto& [id, n] : m) {
      if (!n.retired && (freed_too || n.state != S::kFreed)) ids.push_back(id);
    }
    return ids;
  };
  auto pick = [&](const std::vector<TensorId>& ids) {
    return ids[static_cast<size_t>(
        uniform(0, static_cast<int>(ids.size()) - 1))];
  };
  auto new_spec = [&](SessionId session) {
    TensorSpec s;
    s.id = next_id++;
    s.session = session;
    s.gpu = session == 3 ? 1 : 0;  // sessions 1 and 2 share GPU 0
    s.bytes = uniform(1, 1000);
    s.compute_cost_ns = uniform(0, 1'000'000);
    s.flags.uncomputable = uniform(0, 9) == 0;
    return s;
  };
  auto remember = [&](const TensorSpec& s) {
    ModelNode n;
    n.session = s.session;
    n.gpu = s.gpu;
    n.bytes = s.bytes;
    n.cost = s.compute_cost_ns;
    n.uncomputable = s.flags.uncomputable;
    for (TensorId p : s.parents) {
      if (std::find(n.parents.begin(), n.parents.end(), p) != n.parents.end())
        continue;
      n.parents.push_back(p);
      m.at(p).children.push_back(s.id);
    }
    m.emplace(s.id, std::move(n));
  };
  auto parents_from = [&](SessionId session) {
    std::vector<TensorId> pool;
    for (const auto& [id, n] : m) {
      if (!n.retired && n.state != S::kFreed && n.session == session) {
        pool.push_back(id);
      }
    }
    std::vector<TensorId> out;
    if (pool.empty()) return out;
    const int k = uniform(0, 3);
    for (int i = 0; i < k; ++i) out.push_back(pick(pool));
    return out;
  };

  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(absl::StrCat("seed ", seed, " step ", step));
    const std::vector<TensorId> live = live_ids(/*freed_too=*/true);
    const int op = live.size() < 4 ? 0 : uniform(0, 13);
    if (op <= 2) {  // add one tensor, or a pair listed child first
      const SessionId session = static_cast<SessionId>(uniform(1, 3));
      TensorSpec a = new_spec(session);
      a.parents = parents_from(session);
      if (uniform(0, 3) == 0) {
        TensorSpec b = new_spec(session);
        b.parents = parents_from(session);
        b.parents.push_back(a.id);
        const std::vector<TensorSpec> batch = {b, a};
        ASSERT_TRUE(IsOk(table.AddBatch(batch, step)));
        remember(a);
        remember(b);
      } else {
        ASSERT_TRUE(IsOk(table.Add(a, step)));
        remember(a);
      }
    } else if (op <= 8) {  // any state change, legal or not
      const TensorId id = pick(live);
      ModelNode& n = m.at(id);
      const S to = static_cast<S>(uniform(0, 5));
      const bool ok = testing_util::LegalTransition(n.state, to) &&
                      !(to == S::kEvicted && n.uncomputable);
      const absl::Status s = table.SetState(id, to);
      ASSERT_EQ(s.ok(), ok) << TensorStateName(n.state) << " -> "
                            << TensorStateName(to) << ": " << s.ToString();
      if (ok) {
        if (to == S::kEvicted) n.evicted_from_device = n.state == S::kResident;
        n.state = to;
      }
    } else if (op <= 10) {  // recompute
      const TensorId id = pick(live);
      ModelNode& n = m.at(id);
      const bool ok = (n.state == S::kEvicted || n.state == S::kOffloaded) &&
                      !n.uncomputable;
      ASSERT_EQ(table.MarkRecomputed(id, step).ok(), ok)
          << TensorStateName(n.state);
      if (ok) n.state = S::kResident;
    } else if (op == 11) {  // cancel a release
      const TensorId id = pick(live);
      ModelNode& n = m.at(id);
      const bool ok = (n.state == S::kEvicted && n.evicted_from_device) ||
                      n.state == S::kOffloading;
      ASSERT_EQ(table.CancelRelease(id).ok(), ok) << TensorStateName(n.state);
      if (ok) n.state = S::kResident;
    } else {  // free
      const TensorId id = pick(live);
      ModelNode& n = m.at(id);
      const bool ok = n.state != S::kFreed;
      ASSERT_EQ(table.Free(id).ok(), ok) << TensorStateName(n.state);
      if (ok) {
        n.state = S::kFreed;
        RetireInModel(m);
      }
    }
    CheckTable(table, m);
    if (testing::Test::HasFailure()) return;
  }
}

TEST(EvictedComponentsRandomized, MatchesBruteForceComponentsAfterEveryStep) {
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    RunRandomSequence(seed, 400);
    if (testing::Test::HasFailure()) break;
  }
}

}  // namespace
}  // namespace deltad::policy
