// The swap baselines' plans: vDNN's convolution inputs and the GREEDY
// prefix of the optimal-offloading paper.

#include "policies/sim/swap_policies.h"

#include <algorithm>
#include <cstdint>
#include <set>
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

// The storages read by forward convolutions.
std::set<int32_t> ConvInputs(const Program& p) {
  std::set<int32_t> out;
  for (const Step& step : p.steps) {
    if (step.conv && step.phase == Phase::kForward) {
      out.insert(step.reads.begin(), step.reads.end());
    }
  }
  return out;
}

TEST(Vdnn, OffloadsOnlyConvolutionInputs) {
  const Program p = TraceFor("conv");
  const std::set<int32_t> conv_inputs = ConvInputs(p);
  for (double fraction : {0.6, 0.8, 1.0}) {
    const Outcome run = RunStatic(p, "vdnn", Between(p, fraction));
    ASSERT_TRUE(run.result.fits) << fraction << ": " << run.result.failure;
    ASSERT_FALSE(run.offloaded.empty()) << fraction;
    for (const Event& e : run.offloaded) {
      EXPECT_TRUE(conv_inputs.contains(e.storage))
          << p.storages[e.storage].name << " is not a convolution input";
      EXPECT_FALSE(p.storages[e.storage].constant);
    }
  }
}

TEST(Vdnn, OffloadsEachConvInputOnceAfterItsConvolution) {
  // With room to spare beyond what it releases, vDNN follows its plan alone:
  // r_i is offloaded right after conv i+1 reads it, for each layer whose
  // backward is far enough away to prefetch it back in time.
  const Program p = TraceFor("conv");
  const Outcome run = RunStatic(p, "vdnn", Between(p, 0.8));
  ASSERT_TRUE(run.result.fits) << run.result.failure;
  EXPECT_EQ(run.make_room_calls, 0);
  const int32_t first_backward = FirstBackwardStep(p);
  std::set<int32_t> seen;
  for (const Event& e : run.offloaded) {
    EXPECT_TRUE(seen.insert(e.storage).second)
        << p.storages[e.storage].name << " offloaded twice";
    EXPECT_LT(e.step, first_backward);
    const Step& conv = p.steps[e.step];
    EXPECT_TRUE(conv.conv);
    EXPECT_NE(std::find(conv.reads.begin(), conv.reads.end(), e.storage),
              conv.reads.end());
  }
  EXPECT_GE(seen.size(), 8u);
}

TEST(OffloadGreedy, OffloadsExactlyTheFirstKActivations) {
  for (const char* trace : {"conv", "residual"}) {
    const Program p = TraceFor(trace);
    const std::vector<int32_t> saved = SavedActivations(p);
    for (double fraction : {0.4, 0.6, 0.8}) {
      const int64_t budget = Between(p, fraction);
      // k: the fewest leading saved activations covering peak - budget.
      size_t k = 0;
      for (int64_t sum = 0; sum < p.peak_bytes - budget; ++k) {
        sum += p.storages[saved[k]].bytes;
      }
      const std::vector<int32_t> expected(saved.begin(), saved.begin() + k);
      EXPECT_THAT(OffloadGreedyPrefix(p, budget), ElementsAreArray(expected));
      const Outcome run = RunStatic(p, "offload-greedy", budget);
      ASSERT_TRUE(run.result.fits)
          << trace << " " << fraction << ": " << run.result.failure;
      // Those k and nothing else, each once. Each leaves when the forward
      // pass is done with it, which in a chain is creation order; a skip
      // connection holds its block input until the add.
      if (std::string(trace) == "conv") {
        EXPECT_THAT(Storages(run.offloaded), ElementsAreArray(expected))
            << fraction;
      } else {
        EXPECT_THAT(Storages(run.offloaded),
                    UnorderedElementsAreArray(expected))
            << fraction;
      }
      EXPECT_EQ(run.result.d2h_bytes, run.result.h2d_bytes);
      EXPECT_EQ(run.result.prefetches, static_cast<int64_t>(k));
    }
  }
}

TEST(OffloadGreedy, MovesNothingWhenTheProgramFits) {
  const Program p = TraceFor("conv");
  EXPECT_TRUE(OffloadGreedyPrefix(p, p.peak_bytes).empty());
  const Outcome run = RunStatic(p, "offload-greedy", p.peak_bytes);
  ASSERT_TRUE(run.result.fits) << run.result.failure;
  EXPECT_EQ(run.result.offloads, 0);
  EXPECT_EQ(run.result.makespan_ns, p.compute_ns);
}

}  // namespace
}  // namespace deltad::sim
