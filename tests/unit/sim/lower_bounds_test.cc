// The bounds the static baselines are measured against.

#include "policies/sim/lower_bounds.h"

#include <algorithm>
#include <cstdint>

#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/random_graphs.h"
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

TEST(LowerBounds, MixedIsComputeWhenTheProgramFits) {
  for (const char* trace : {"conv", "residual"}) {
    const Program p = TraceFor(trace);
    const LowerBounds lb = ComputeLowerBounds(p, TestDevice(), p.peak_bytes);
    EXPECT_EQ(lb.mixed_ns, p.compute_ns) << trace;
  }
}

TEST(LowerBounds, MixedChargesWhatMustLeaveAroundTheStep) {
  // On a link a thousand times slower than compute, what must leave costs
  // more than rebuilding it, which the conv chain's activations allow: the
  // bound is above the compute time (something must be rebuilt) and far
  // below the swap-only bound.
  const Program p = TraceFor("conv");
  const int64_t budget = Between(p, 0.5);
  const LowerBounds slow = ComputeLowerBounds(p, TestDevice(1e6, 1e6), budget);
  EXPECT_GT(slow.mixed_ns, p.compute_ns);
  EXPECT_LT(slow.mixed_ns, slow.swap_only_ns);
  // On a link a thousand times faster the copies hide almost entirely: a
  // lower bound, but not above the slow link's.
  const LowerBounds fast =
      ComputeLowerBounds(p, TestDevice(1e12, 1e12), budget);
  EXPECT_GE(fast.mixed_ns, p.compute_ns);
  EXPECT_LE(fast.mixed_ns, slow.mixed_ns);
  // A smaller budget can only raise it.
  const LowerBounds tighter =
      ComputeLowerBounds(p, TestDevice(1e6, 1e6), Between(p, 0.2));
  EXPECT_GE(tighter.mixed_ns, slow.mixed_ns);
}

// The bound is for any schedule: no policy of the simulator may beat it,
// on graphs no one shaped for it, at any budget, over one iteration or
// the second of two (which may start with constants on the host).
TEST(LowerBounds, NoPolicyBeatsTheMixedBound) {
  const DeviceProfile device = *FindDeviceProfile("a100-80gb");
  int runs = 0;
  int above_compute = 0;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    const Program p = *Compile(RandomLayerGraph(seed));
    for (double fraction : {0.3, 0.5, 0.7, 0.9}) {
      const auto budget =
          static_cast<int64_t>(fraction * static_cast<double>(p.peak_bytes));
      const LowerBounds lb = ComputeLowerBounds(p, device, budget);
      above_compute += lb.mixed_ns > p.compute_ns ? 1 : 0;
      for (const std::string& name : PolicyNames()) {
        auto policy = MakePolicy(name);
        ASSERT_TRUE(policy.ok()) << policy.status();
        SimOptions o;
        o.budget_bytes = budget;
        o.iterations = IterationsFor(name);
        auto r = Simulate(p, device, **policy, o);
        if (!r.ok() || !r->fits) continue;
        ++runs;
        EXPECT_GE(r->makespan_ns, lb.mixed_ns)
            << name << " on random graph " << seed << " at " << fraction;
      }
    }
  }
  EXPECT_GT(runs, 200);
  EXPECT_GT(above_compute, 0) << "a bound that never says more than compute";
}

}  // namespace
}  // namespace deltad::sim
