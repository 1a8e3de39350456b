// The checkpointing baselines' plans: Chen et al.'s sqrt(n) checkpoints and
// their budget greedy plan.

#include "policies/sim/checkpoint_policies.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/program.h"
#include "policies/sim/program_analysis.h"
#include "tests/unit/sim/static_policies_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAreArray;
using ::testing::UnorderedElementsAreArray;

TEST(ChenSqrt, KeepsEveryCeilSqrtNthActivation) {
  for (const char* trace : {"conv", "residual"}) {
    const Program p = TraceFor(trace);
    const std::vector<int32_t> saved = SavedActivations(p);
    const size_t n = saved.size();
    const auto k = static_cast<size_t>(std::ceil(std::sqrt(n)));
    std::vector<int32_t> expected;
    std::vector<int32_t> dropped;
    for (size_t i = 0; i < n; ++i) {
      ((i + 1) % k == 0 ? expected : dropped).push_back(saved[i]);
    }
    EXPECT_THAT(ChenSqrtCheckpoints(p), ElementsAreArray(expected)) << trace;
    EXPECT_EQ(expected.size(), n / k);

    // Where the plan suffices it evicts exactly the non-checkpoints, each
    // right after its last forward use, and nothing more.
    const Outcome run = RunStatic(p, "chen-sqrt", Between(p, 0.8));
    ASSERT_TRUE(run.result.fits) << trace << ": " << run.result.failure;
    EXPECT_EQ(run.make_room_calls, 0) << trace;
    EXPECT_THAT(Storages(run.evicted), UnorderedElementsAreArray(dropped))
        << trace;
    const int32_t first_backward = FirstBackwardStep(p);
    for (const Event& e : run.evicted) EXPECT_LT(e.step, first_backward);
    // Each dropped activation is rebuilt once for backward; in the residual
    // trace, rebuilding a block output also rebuilds the dead sum operand.
    if (std::string(trace) == "conv") {
      EXPECT_EQ(run.result.recomputes, static_cast<int64_t>(dropped.size()));
    } else {
      EXPECT_GE(run.result.recomputes, static_cast<int64_t>(dropped.size()));
    }
  }
}

TEST(ChenGreedy, DropsNothingWhenTheProgramFits) {
  for (const char* trace : {"conv", "residual"}) {
    const Program p = TraceFor(trace);
    const Outcome run = RunStatic(p, "chen-greedy", p.peak_bytes);
    ASSERT_TRUE(run.result.fits) << run.result.failure;
    EXPECT_EQ(run.result.evictions, 0) << trace;
    EXPECT_EQ(run.result.makespan_ns, p.compute_ns) << trace;
  }
}

TEST(ChenGreedy, RecomputesNoMoreThanSqrtWhereBothFitTheirPlans) {
  // The budget plan drops only what the budget needs; sqrt(n) drops a fixed
  // share whatever the budget.
  for (const char* trace : {"conv", "residual"}) {
    const Program p = TraceFor(trace);
    const int64_t budget = Between(p, 0.8);
    const Outcome greedy = RunStatic(p, "chen-greedy", budget);
    const Outcome sqrt = RunStatic(p, "chen-sqrt", budget);
    ASSERT_TRUE(greedy.result.fits && sqrt.result.fits) << trace;
    EXPECT_LE(greedy.result.recompute_ns, sqrt.result.recompute_ns) << trace;
    EXPECT_LE(greedy.result.peak_bytes, budget);
  }
}

}  // namespace
}  // namespace deltad::sim
