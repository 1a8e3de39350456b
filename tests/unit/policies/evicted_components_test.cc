#include "policies/evicted_components.h"

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::policy {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

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

}  // namespace
}  // namespace deltad::policy
