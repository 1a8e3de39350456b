#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/evicted_components.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/legal_transitions.h"
#include "tests/unit/policies/status_assertions.h"

// Random sequences of table calls, checked after every step against a
// brute-force oracle of the evicted components.
namespace deltad::policy {
namespace {

using testing_util::IsOk;
using S = TensorState;

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
