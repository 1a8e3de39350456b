#ifndef DELTAD_TESTS_UNIT_POLICIES_FILTER_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_POLICIES_FILTER_TEST_HELPERS_H_

// What the tests of the Filter and of its heuristics share: tables of
// tensors and the order in which the Filter releases them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "policies/filter.h"
#include "policies/heuristic.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"
#include "tests/unit/policies/tensor_table_test_helpers.h"

namespace deltad::policy {

// Knuth's MMIX linear congruential generator, its high 31 bits: the same
// tables on every platform, which std's distributions do not promise.
class TestLcg {
 public:
  explicit TestLcg(uint64_t seed) : x_(seed) {}
  uint64_t operator()() {
    x_ = x_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return x_ >> 33;
  }

 private:
  uint64_t x_;
};

inline TensorSpec Spec(TensorId id, int64_t bytes, int64_t compute_cost_ns = 0,
                       std::vector<TensorId> parents = {},
                       SessionId session = 1, GpuId gpu = 0) {
  TensorSpec s;
  s.id = id;
  s.session = session;
  s.gpu = gpu;
  s.bytes = bytes;
  s.compute_cost_ns = compute_cost_ns;
  s.parents = std::move(parents);
  return s;
}

// Adds a tensor whose last access is `at_ns`.
inline void AddAt(TensorTable& table, const TensorSpec& spec, int64_t at_ns) {
  const absl::Status s = table.Add(spec, at_ns);
  ASSERT_TRUE(s.ok()) << s;
}

inline void Evict(TensorTable& table, TensorId id) {
  const absl::Status s = table.SetState(id, TensorState::kEvicted);
  ASSERT_TRUE(s.ok()) << s;
}

inline FilterOptions Options(Heuristic h, bool sampled = false,
                             bool skip_small = false, uint64_t seed = 1,
                             MegEngineParams me = {}) {
  FilterOptions o;
  o.heuristic = h;
  o.sampled = sampled;
  o.skip_small = skip_small;
  o.seed = seed;
  o.megengine = me;
  return o;
}

// The order in which the Filter would release every candidate of `scope`,
// scores fixed at `now_ns` (each pick is excluded from the next search).
inline std::vector<TensorId> ReleaseOrder(const TensorTable& table, Heuristic h,
                                          const Scope& scope, int64_t now_ns,
                                          MegEngineParams me = {}) {
  Filter filter(Options(h, false, false, 1, me));
  std::vector<TensorId> order;
  while (true) {
    absl::StatusOr<uint32_t> pick =
        filter.Select(table, scope, now_ns, [&order](const Tensor& t) {
          return std::find(order.begin(), order.end(), t.id) == order.end();
        });
    if (!pick.ok()) {
      EXPECT_TRUE(absl::IsNotFound(pick.status())) << pick.status();
      break;
    }
    order.push_back(table.AtSlot(*pick).id);
  }
  return order;
}

inline const Scope kGpu0 = testing_util::GpuScope(0);

// What an exact search must pick: the first candidate in list order with
// the lowest score among those `eligible`, every one scored.
inline uint32_t FirstLowestScore(const Filter& filter, const TensorTable& table,
                                 int64_t now_ns, Filter::Eligible eligible) {
  uint32_t want = UINT32_MAX;
  double want_score = INFINITY;
  for (uint32_t slot : table.Candidates(kGpu0)) {
    if (!eligible(table.AtSlot(slot))) continue;
    const double score = filter.Score(table, slot, now_ns);
    if (want == UINT32_MAX || score < want_score) {
      want = slot;
      want_score = score;
    }
  }
  return want;
}

}  // namespace deltad::policy

#endif  // DELTAD_TESTS_UNIT_POLICIES_FILTER_TEST_HELPERS_H_
