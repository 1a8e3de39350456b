#include "policies/sim/random_graphs.h"

#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "policies/sim/allocator_model.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {
namespace {

constexpr uint64_t kSeeds = 12;

TEST(RandomLayerGraph, IsValidAndTheSameForTheSameSeed) {
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    SCOPED_TRACE(seed);
    const Trace t = RandomLayerGraph(seed);
    EXPECT_EQ(t.name, absl::StrCat("random-", seed));
    ASSERT_TRUE(t.Validate().ok()) << t.Validate();
    ASSERT_TRUE(Compile(t).ok());
    const Trace again = RandomLayerGraph(seed);
    ASSERT_EQ(again.ops.size(), t.ops.size());
    ASSERT_EQ(again.values.size(), t.values.size());
    for (size_t v = 0; v < t.values.size(); ++v) {
      EXPECT_EQ(again.values[v].bytes, t.values[v].bytes);
    }
  }
  EXPECT_NE(
      RandomLayerGraph(1).ops.size() * 1000 + RandomLayerGraph(1).values.size(),
      RandomLayerGraph(2).ops.size() * 1000 +
          RandomLayerGraph(2).values.size());
}

// Every planner fits at a budget of the trace's own peak under each
// allocator model (what `none` occupies there, rounding and holes
// included), or says why not: in a best-fit arena, where blocks never move,
// releasing in another order than `none` can leave the free bytes in
// pieces too small; nowhere else.
TEST(RandomLayerGraph, EveryPlannerFitsAtThePeakUnderEveryAllocatorModel) {
  const DeviceProfile device = *FindDeviceProfile("a100-80gb");
  std::vector<std::string> failures;
  int fragmented = 0;
  int runs = 0;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    const Program program = *Compile(RandomLayerGraph(seed));
    for (AllocatorKind allocator :
         {AllocatorKind::kExact, AllocatorKind::kBestFit,
          AllocatorKind::kVmChunks, AllocatorKind::kPyTorchCaching}) {
      // The peak of a run of as many iterations as the policy runs, by
      // that count: most policies share one.
      std::map<int, int64_t> peaks;
      for (const std::string& name : PolicyNames()) {
        const int iterations = IterationsFor(name);
        if (!peaks.contains(iterations)) {
          auto peak = UnlimitedPeak(program, device, allocator, iterations);
          ASSERT_TRUE(peak.ok()) << peak.status();
          peaks[iterations] = *peak;
        }
        auto policy = MakePolicy(name);
        ASSERT_TRUE(policy.ok()) << policy.status();
        SimOptions o;
        o.budget_bytes = peaks[iterations];
        o.host_bytes = int64_t{64} << 30;
        o.allocator = allocator;
        o.iterations = iterations;
        auto r = Simulate(program, device, **policy, o);
        ++runs;
        ASSERT_TRUE(r.ok())
            << program.name << " " << name << ": " << r.status();
        if (r->fits) continue;
        if (allocator == AllocatorKind::kBestFit &&
            absl::StrContains(r->failure, "(fragmentation:")) {
          ++fragmented;
          continue;
        }
        failures.push_back(absl::StrCat(program.name, " ", name, " ",
                                        AllocatorKindName(allocator), ": ",
                                        r->failure));
      }
    }
  }
  EXPECT_TRUE(failures.empty()) << failures.size() << " runs did not fit:\n"
                                << absl::StrJoin(failures, "\n");
  // Fragmentation in the arena stays the exception.
  EXPECT_LT(fragmented * 20, runs) << fragmented << " of " << runs;
}

// The second iteration starts from the weights the first updated in
// place, in their memory: a run that keeps everything needs no more for
// two iterations than for one, even where an allocator places blocks.
// (Re-made beside their last versions, the weights were held twice at the
// iteration's start, and every graph's second iteration needed more in a
// best-fit arena.)
TEST(RandomLayerGraph, TheSecondIterationStartsInTheFirstsWeights) {
  const DeviceProfile device = *FindDeviceProfile("a100-80gb");
  const Program program = *Compile(RandomLayerGraph(3));
  ASSERT_FALSE(program.carries.empty());
  const int64_t one = *UnlimitedPeak(program, device, AllocatorKind::kBestFit);
  EXPECT_EQ(*UnlimitedPeak(program, device, AllocatorKind::kBestFit, 2), one);
  SimOptions o;
  o.allocator = AllocatorKind::kBestFit;
  o.iterations = 2;
  o.budget_bytes = one;
  auto keep_all = MakePolicy("none");
  auto r = Simulate(program, device, **keep_all, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->fits) << r->failure;
}

// chen-sqrt's checkpoints leave the arena in pieces at step 41 of this
// graph; the simulator frees the blocks of one range (Engine::FreeRangeFor)
// and the run fits, where before it ran out with enough bytes free.
TEST(RandomLayerGraph, FreeingOneRangeFitsARunThatFragmentedTheArena) {
  const DeviceProfile device = *FindDeviceProfile("a100-80gb");
  const Program program = *Compile(RandomLayerGraph(2));
  SimOptions o;
  o.allocator = AllocatorKind::kBestFit;
  o.budget_bytes = *UnlimitedPeak(program, device, o.allocator);
  auto policy = MakePolicy("chen-sqrt");
  auto r = Simulate(program, device, **policy, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->fits) << r->failure;
  EXPECT_GT(r->range_releases, 0);
}

}  // namespace
}  // namespace deltad::sim
