// The ReleasePlanner tests' tensors and fixture: a table, a Filter (delta,
// exact), a Director and a planner over them, with 1 GB/s links each way.
#ifndef DELTAD_TESTS_UNIT_POLICIES_RELEASE_PLANNER_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_POLICIES_RELEASE_PLANNER_TEST_HELPERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/director.h"
#include "policies/filter.h"
#include "policies/release_planner.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

inline constexpr SessionId kSession = 1;
inline constexpr int64_t kPlenty = int64_t{1} << 40;  // host bytes

// With 1 GB/s each way a tensor of b bytes has c_s = 2b ns: compute cost 0
// makes it an eviction (F = 0), 10 ns per byte an offload (F = 5).
enum class Kind { kCheap, kCostly };

inline TensorSpec Spec(TensorId id, int64_t bytes, Kind kind,
                       std::vector<TensorId> parents = {},
                       TensorFlags flags = {}, SessionId session = kSession) {
  TensorSpec s;
  s.id = id;
  s.session = session;
  s.gpu = 0;
  s.bytes = bytes;
  s.flags = flags;
  s.compute_cost_ns = kind == Kind::kCheap ? 0 : 10 * bytes;
  s.parents = std::move(parents);
  return s;
}

inline FilterOptions Options(Heuristic h) {
  FilterOptions o;
  o.heuristic = h;
  return o;
}

inline Scope SessionScope(SessionId session) { return Scope{0, session}; }
inline Scope GpuScope(GpuId gpu) { return Scope{gpu, std::nullopt}; }

inline std::vector<TensorId> Ids(const std::vector<ReleaseOrder>& orders) {
  std::vector<TensorId> ids;
  for (const ReleaseOrder& o : orders) ids.push_back(o.id);
  return ids;
}

inline std::vector<ReleaseAction> Actions(
    const std::vector<ReleaseOrder>& orders) {
  std::vector<ReleaseAction> actions;
  for (const ReleaseOrder& o : orders) actions.push_back(o.action);
  return actions;
}

inline int64_t Bytes(const std::vector<ReleaseOrder>& orders) {
  int64_t sum = 0;
  for (const ReleaseOrder& o : orders) sum += o.bytes;
  return sum;
}

inline std::string StatsString(const MemoryStats& s) {
  return absl::StrCat("device=", s.device_bytes,
                      " releasing=", s.releasing_bytes, " host=", s.host_bytes,
                      " evicted=", s.evicted_bytes, " tensors=", s.tensors);
}

inline constexpr ReleaseAction kEvict = ReleaseAction::kEvict;
inline constexpr ReleaseAction kOffload = ReleaseAction::kOffload;

class ReleasePlannerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(costs_.SetBandwidth(0, {1e9, 1e9}).ok());
  }
  void Add(const TensorSpec& spec, int64_t at_ns) {
    const absl::Status s = table_.Add(spec, at_ns);
    ASSERT_TRUE(s.ok()) << s;
  }
  TensorState State(TensorId id) const { return table_.Find(id)->state; }
  absl::StatusOr<std::vector<ReleaseOrder>> Release(int64_t bytes,
                                                    int64_t host = kPlenty) {
    return planner_.Release(SessionScope(kSession), bytes, kNow, host);
  }

  // Everything a failed Release must leave as it was.
  std::string Snapshot(TensorId max_id) const {
    std::string out;
    for (TensorId id = 1; id <= max_id; ++id) {
      const Tensor* t = table_.Find(id);
      if (t == nullptr) continue;
      absl::StrAppend(&out, id, ": ", TensorStateName(t->state),
                      " recomputes=", t->recompute_count,
                      " tick=", t->last_access_tick, " at=", t->last_access_ns,
                      " c_r=", RecomputeNs(table_, table_.SlotOf(id)), "\n");
    }
    absl::StrAppend(
        &out, "session ", StatsString(table_.SessionStats(kSession)), "\ngpu ",
        StatsString(table_.GpuStats(0)),
        "\ncandidates=", table_.Candidates(SessionScope(kSession)).size(),
        " bytes=", table_.CandidateBytes(SessionScope(kSession)),
        " components=", table_.components().size(), "\n");
    return out;
  }

  static constexpr int64_t kNow = 1000;
  TensorTable table_;
  CostModel costs_;
  Director director_{costs_};
  Filter filter_;  // delta, exact
  ReleasePlanner planner_{table_, filter_, director_};
};

}  // namespace deltad::policy

#endif  // DELTAD_TESTS_UNIT_POLICIES_RELEASE_PLANNER_TEST_HELPERS_H_
