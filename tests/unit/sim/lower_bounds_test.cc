// The bounds the static baselines are measured against.

#include "policies/sim/lower_bounds.h"

#include <algorithm>
#include <cstdint>

#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"
#include "tests/unit/sim/static_policies_test_helpers.h"

namespace deltad::sim {
namespace {

TEST(LowerBounds, ComputeIsTheSumOfStepTimes) {
  const Program p = TraceFor("conv");
  int64_t sum = 0;
  for (const Step& step : p.steps) sum += step.time_ns;
  const LowerBounds lb = ComputeLowerBounds(p, TestDevice(), p.peak_bytes / 2);
  EXPECT_EQ(lb.compute_ns, sum);
  EXPECT_EQ(lb.compute_ns, p.compute_ns);
  EXPECT_GE(lb.swap_only_ns, lb.compute_ns);
}

TEST(LowerBounds, SwapOnlyIsComputeWhenTheProgramFits) {
  const Program p = TraceFor("conv");
  for (int64_t budget : {p.peak_bytes, 2 * p.peak_bytes}) {
    const LowerBounds lb = ComputeLowerBounds(p, TestDevice(), budget);
    EXPECT_EQ(lb.swap_only_ns, p.compute_ns);
  }
}

TEST(LowerBounds, SwapOnlyIsTwiceTheExcessOverTheLinkWhenThatDominates) {
  const Program p = TraceFor("conv");
  const int64_t budget = p.min_budget_bytes;
  const int64_t excess = p.peak_bytes - budget;
  // 0.01 byte per ns: copying the excess both ways takes far longer than
  // computing.
  const LowerBounds slow = ComputeLowerBounds(p, TestDevice(1e7, 1e7), budget);
  ASSERT_GT(2 * excess * 100, p.compute_ns);
  EXPECT_EQ(slow.swap_only_ns, 2 * excess * 100);
  // 10 bytes per ns: the copies hide behind compute.
  const LowerBounds fast =
      ComputeLowerBounds(p, TestDevice(1e10, 1e10), budget);
  ASSERT_LT(2 * excess / 10, p.compute_ns);
  EXPECT_EQ(fast.swap_only_ns, p.compute_ns);
}

TEST(LowerBounds, EachDirectionIsChargedAtItsOwnRate) {
  // Out at 0.01 byte per ns, back at 0.1: the excess leaves once and comes
  // back once. Charging both ways at the slower rate would exceed what a
  // schedule can achieve.
  const Program p = TraceFor("conv");
  const int64_t budget = p.min_budget_bytes;
  const int64_t excess = p.peak_bytes - budget;
  const LowerBounds lb = ComputeLowerBounds(p, TestDevice(1e8, 1e7), budget);
  EXPECT_EQ(lb.swap_only_ns,
            std::max(p.compute_ns, excess * 100 + excess * 10));
}

TEST(LowerBounds, NoSwapBaselineBeatsTheSwapOnlyBound) {
  // On a slow link the bound is the copy time, not compute.
  for (const char* trace : {"conv", "residual"}) {
    const Program p = TraceFor(trace);
    const DeviceProfile slow = TestDevice(1e8, 1e8);
    int fits = 0;
    for (double fraction : {0.3, 0.6, 0.9}) {
      const int64_t budget = Between(p, fraction);
      const LowerBounds lb = ComputeLowerBounds(p, slow, budget);
      for (const char* policy : {"vdnn", "lms", "window", "offload-greedy"}) {
        const Outcome run = RunStatic(p, policy, budget, slow);
        if (!run.result.fits) continue;  // nothing to bound
        ++fits;
        EXPECT_GE(run.result.makespan_ns, lb.swap_only_ns)
            << trace << " " << policy << " " << fraction;
        if (fraction < 0.9) {
          EXPECT_GT(lb.swap_only_ns, lb.compute_ns) << trace << " " << fraction;
        }
        EXPECT_LE(run.result.peak_bytes, budget);
      }
    }
    // LMS, window and GREEDY release every saved activation if they must.
    EXPECT_GE(fits, 9) << trace;
  }
}

}  // namespace
}  // namespace deltad::sim
