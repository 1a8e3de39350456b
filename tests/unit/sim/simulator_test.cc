#include "policies/sim/simulator.h"

#include <atomic>
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/dtr_log.h"
#include "policies/sim/dynamic_policy.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/trace.h"
#include "tests/unit/sim/simulator_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;
using testing_util::ChainTrace;
using testing_util::Compiled;
using testing_util::RunPolicy;
using testing_util::TestDevice;

TEST(Simulator, NoneWithPeakBudgetRunsAtIdealTime) {
  const Program p = Compiled(ChainTrace(8, 1000, 1000));
  const SimResult r = RunPolicy(p, "none", p.peak_bytes);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.makespan_ns, p.compute_ns);
  EXPECT_EQ(r.peak_bytes, p.peak_bytes);
  EXPECT_EQ(r.d2h_bytes + r.h2d_bytes + r.recompute_ns + r.stall_ns, 0);
}

TEST(Simulator, NoneBelowPeakDoesNotFit) {
  const Program p = Compiled(ChainTrace(8, 1000, 1000));
  const SimResult r = RunPolicy(p, "none", p.peak_bytes - 1);
  EXPECT_FALSE(r.fits);
  EXPECT_THAT(r.failure, HasSubstr("out of memory"));
}

TEST(Simulator, BudgetBelowTheLargestStepIsInfeasible) {
  const Program p = Compiled(ChainTrace(8, 1000, 1000));
  auto policy = MakePolicy("delta");
  ASSERT_TRUE(policy.ok());
  SimOptions o;
  o.budget_bytes = p.min_budget_bytes - 1;
  auto r = Simulate(p, TestDevice(), **policy, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("infeasible: needs at least ",
                                     p.min_budget_bytes, " bytes")));
}

TEST(Simulator, ARunGivesUpOnceItsClockReachesTheLimit) {
  const Program p = Compiled(ChainTrace(8, 1000, 1000));
  auto none = MakePolicy("none");
  ASSERT_TRUE(none.ok());
  SimOptions o;
  o.budget_bytes = p.peak_bytes;
  o.give_up_at_ns = p.compute_ns / 2;
  auto r = Simulate(p, TestDevice(), **none, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->fits);
  EXPECT_TRUE(r->gave_up);
  EXPECT_THAT(r->failure, HasSubstr("gave up"));
  // A limit past the end changes nothing.
  o.give_up_at_ns = p.compute_ns + 1;
  r = Simulate(p, TestDevice(), **none, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->fits);
  EXPECT_FALSE(r->gave_up);
  EXPECT_EQ(r->makespan_ns, p.compute_ns);
}

// Steps to come take at least their op time: a run that can no longer end
// before the limit stops at once, not when its clock gets there.
TEST(Simulator, ARunGivesUpOnceItCanNoLongerEndBeforeTheLimit) {
  const Program p = Compiled(ChainTrace(8, 1000, 1000));
  ASSERT_GT(p.steps.size(), 2u);
  auto none = MakePolicy("none");
  ASSERT_TRUE(none.ok());
  SimOptions o;
  o.budget_bytes = p.peak_bytes;
  // Ending exactly at the limit is not ending before it.
  o.give_up_at_ns = p.compute_ns;
  auto r = Simulate(p, TestDevice(), **none, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->gave_up);
  EXPECT_THAT(r->failure, HasSubstr(absl::StrCat("gave up at ",
                                                 p.steps[0].time_ns, " ns")));
  // Two iterations: the limit is on the measured (second) one, which gives
  // up at its own first step; the first runs to its end.
  o.iterations = 2;
  o.give_up_at_ns = p.compute_ns - 1;
  r = Simulate(p, TestDevice(), **none, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->gave_up);
  EXPECT_THAT(r->failure,
              HasSubstr(absl::StrCat(
                  "gave up at ", p.compute_ns + p.steps[0].time_ns, " ns")));
  o.give_up_at_ns = p.compute_ns + 1;
  r = Simulate(p, TestDevice(), **none, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->fits);
  EXPECT_EQ(r->total_makespan_ns, 2 * p.compute_ns);
}

// Stands in for a replay on another thread that finishes first: lowers the
// shared limit after the run's second step.
class LowersTheLimit final : public SimPolicy {
 public:
  explicit LowersTheLimit(std::atomic<int64_t>& limit) : limit_(limit) {}
  std::string name() const override { return "lowers-the-limit"; }
  void AfterStep(SimContext& /*ctx*/, int32_t step) override {
    if (step == 1) limit_ = 1;
  }
  bool MakeRoom(SimContext& /*ctx*/, int64_t /*bytes*/) override {
    return false;
  }

 private:
  std::atomic<int64_t>& limit_;
};

// Planners replaying candidates on several threads share one limit, which
// each lowers as it finishes: a run reads it at every step, in place of
// its own.
TEST(Simulator, ARunGivesUpAtASharedLimitLoweredWhileItRuns) {
  const Program p = Compiled(ChainTrace(8, 1000, 1000));
  ASSERT_GT(p.steps.size(), 3u);
  auto none = MakePolicy("none");
  ASSERT_TRUE(none.ok());
  std::atomic<int64_t> limit{p.compute_ns + 1};
  SimOptions o;
  o.budget_bytes = p.peak_bytes;
  o.give_up_at_ns = 1;  // not read: the shared limit is
  o.shared_give_up_at_ns = &limit;
  auto r = Simulate(p, TestDevice(), **none, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->fits);
  EXPECT_EQ(r->makespan_ns, p.compute_ns);
  LowersTheLimit lowers(limit);
  r = Simulate(p, TestDevice(), lowers, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->gave_up);
  EXPECT_THAT(r->failure, HasSubstr(absl::StrCat(
                              "gave up at ",
                              p.steps[0].time_ns + p.steps[1].time_ns, " ns")));
}

TEST(Simulator, RejectsBadOptions) {
  const Program p = Compiled(ChainTrace(2, 1000, 1000));
  NoReleasePolicy none;
  SimOptions o;
  o.budget_bytes = 0;
  EXPECT_EQ(Simulate(p, TestDevice(), none, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.budget_bytes = p.peak_bytes;
  o.iterations = 0;
  EXPECT_EQ(Simulate(p, TestDevice(), none, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Releases nothing, like `none`, but says its bookkeeping went wrong.
class InconsistentPolicy : public SimPolicy {
 public:
  std::string name() const override { return "inconsistent"; }
  bool MakeRoom(SimContext&, int64_t) override { return false; }
  absl::Status Consistency() const override {
    return absl::InternalError("tensor 7 is resident in the table only");
  }
};

TEST(Simulator, FailsARunWhosePolicyReportsAnInconsistentState) {
  const Program p = Compiled(ChainTrace(2, 1000, 1000));
  InconsistentPolicy policy;
  SimOptions o;
  o.budget_bytes = p.peak_bytes;
  auto r = Simulate(p, TestDevice(), policy, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(r.status().message(), HasSubstr("inconsistent state"));
  EXPECT_THAT(r.status().message(),
              HasSubstr("tensor 7 is resident in the table only"));
}

TEST(Simulator, UnlimitedPeakIsTheProgramsPeakOrMoreWhereTheAllocatorRounds) {
  const Program p = Compiled(ChainTrace(8, 1000, 1000));
  auto exact = UnlimitedPeak(p, TestDevice(), AllocatorKind::kExact);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(*exact, p.peak_bytes);
  // Eight 1000-byte activations and the rest, each rounded to 2 MiB.
  auto chunks = UnlimitedPeak(p, TestDevice(), AllocatorKind::kVmChunks);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  EXPECT_GT(*chunks, p.peak_bytes);
  // At that budget `none` fits, at one byte less it does not.
  EXPECT_TRUE(RunPolicy(p, "none", *chunks, AllocatorKind::kVmChunks).fits);
  EXPECT_FALSE(
      RunPolicy(p, "none", *chunks - 1, AllocatorKind::kVmChunks).fits);
}

class EveryReleasingPolicy : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryReleasingPolicy, FitsHalfThePeakWithinBudgetAndAccountsTime) {
  const Program p = Compiled(ChainTrace(12, 1000, 1000));
  const int64_t budget = p.peak_bytes / 2;
  ASSERT_GE(budget, p.min_budget_bytes);
  const SimResult r = RunPolicy(p, GetParam(), budget);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_LE(r.peak_bytes, budget);
  EXPECT_GE(r.makespan_ns, p.compute_ns);
  // The compute stream only ever runs ops, recomputes, or waits.
  EXPECT_EQ(r.makespan_ns, p.compute_ns + r.recompute_ns + r.stall_ns);
  // Nothing comes back that did not go out.
  EXPECT_LE(r.h2d_bytes, r.d2h_bytes);
  EXPECT_GT(r.offloads + r.evictions, 0);
}

INSTANTIATE_TEST_SUITE_P(Policies, EveryReleasingPolicy,
                         ::testing::Values("dtr", "dtr-sampled", "swap-lru",
                                           "delta", "delta-replay"));

TEST(Simulator, DtrOnlyRecomputes) {
  const Program p = Compiled(ChainTrace(12, 1000, 1000));
  const SimResult r = RunPolicy(p, "dtr", p.peak_bytes / 2);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.d2h_bytes + r.h2d_bytes, 0);
  EXPECT_GT(r.recomputes, 0);
  EXPECT_GT(r.recompute_ns, 0);
}

TEST(Simulator, SwapLruOnlyCopies) {
  const Program p = Compiled(ChainTrace(12, 1000, 1000));
  const SimResult r = RunPolicy(p, "swap-lru", p.peak_bytes / 2);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.evictions + r.recomputes, 0);
  EXPECT_GT(r.d2h_bytes, 0);
  EXPECT_GT(r.h2d_bytes, 0);
}

TEST(Simulator, DeltaOffloadsWhatIsDearToRecompute) {
  // Recompute costs 4x a copy: the Director offloads, and prefetching in
  // backward hides most of the reload time.
  const Program p = Compiled(ChainTrace(12, 1000, 1000, /*heavy=*/true));
  const SimResult delta = RunPolicy(p, "delta", p.peak_bytes / 2);
  const SimResult dtr = RunPolicy(p, "dtr", p.peak_bytes / 2);
  ASSERT_TRUE(delta.fits) << delta.failure;
  ASSERT_TRUE(dtr.fits) << dtr.failure;
  EXPECT_GT(delta.offloads, 0);
  EXPECT_GT(delta.prefetches, 0);
  EXPECT_LT(delta.makespan_ns, dtr.makespan_ns);
}

TEST(Simulator, OneCopyEngineSerialisesBothDirections) {
  const Program p = Compiled(ChainTrace(12, 1000, 1000, /*heavy=*/true));
  const SimResult two =
      RunPolicy(p, "delta", p.peak_bytes / 2, AllocatorKind::kExact,
                /*copy_engines=*/2);
  const SimResult one =
      RunPolicy(p, "delta", p.peak_bytes / 2, AllocatorKind::kExact,
                /*copy_engines=*/1);
  ASSERT_TRUE(two.fits && one.fits);
  EXPECT_GE(one.makespan_ns, two.makespan_ns);
}

TEST(Simulator, ChunkedAllocatorRoundsLargeBlocksUp) {
  // 3 MiB activations on 2 MiB chunks take 4 MiB each.
  const int64_t mib = int64_t{1} << 20;
  const Program p = Compiled(ChainTrace(4, 3 * mib, 1000));
  const SimResult exact = RunPolicy(p, "none", 64 * mib, AllocatorKind::kExact);
  const SimResult chunks =
      RunPolicy(p, "none", 64 * mib, AllocatorKind::kVmChunks);
  ASSERT_TRUE(exact.fits && chunks.fits);
  EXPECT_EQ(exact.peak_bytes, p.peak_bytes);
  EXPECT_GT(chunks.peak_bytes, exact.peak_bytes);
}

TEST(Simulator, DeltaOnTheBestFitArenaWithEmptyTensorsStaysWithinBudget) {
  // Mixed sizes fragment the arena; empty tensors come from real logs.
  TraceBuilder b("mixed");
  int32_t prev = b.Constant("x", 4096);
  std::vector<int32_t> saved;
  for (int i = 0; i < 16; ++i) {
    b.Op("f", Phase::kForward, 1000).Input(prev);
    prev = b.Output(absl::StrCat("a", i), (i % 3 + 1) * 4096);
    b.Output(absl::StrCat("empty", i), 0);
    saved.push_back(prev);
  }
  for (int i = 15; i >= 0; --i) {
    b.Op("f_backward", Phase::kBackward, 1000).Input(saved[i]);
    b.Release(saved[i]);
  }
  const Program p = Compiled(std::move(b).Build());
  const SimResult r =
      RunPolicy(p, "delta", p.peak_bytes / 2, AllocatorKind::kBestFit);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_LE(r.peak_bytes, p.peak_bytes / 2);
}

// A weight updated in place (storages: w, x, y, w's new version, z).
Program UpdatedWeightProgram(int64_t y_bytes = 100) {
  TraceBuilder b("carry");
  const int32_t w = b.Constant("w", 1000);
  const int32_t x = b.Constant("x", 100);
  b.Op("f", Phase::kForward, 1000).Input(x).Input(w);
  const int32_t y = b.Output("y", y_bytes);
  b.Op("update", Phase::kBackward, 1000).Input(y);
  b.Version(w);
  b.Release(y);
  b.Op("g", Phase::kBackward, 10000).Input(x);
  b.Release(b.Output("z", 100));
  return Compiled(std::move(b).Build());
}

TEST(Program, AWeightUpdatedInPlaceCarriesItsLastVersionToTheNextIteration) {
  const Program p = UpdatedWeightProgram();
  ASSERT_EQ(p.carries.size(), 1u);
  EXPECT_EQ(p.carries[0].constant, 0);
  EXPECT_EQ(p.carries[0].final, p.steps[1].creates[0]);
}

TEST(Simulator, AWeightOffloadedInItsLastVersionIsReloadedInTheNextIteration) {
  const Program p = UpdatedWeightProgram();
  const int32_t last = p.carries[0].final;
  testing_util::Scripted policy;
  bool offloaded = false;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    if (step == 1 && !offloaded) offloaded = ctx.Offload(last);
  };
  SimOptions o;
  o.budget_bytes = int64_t{1} << 20;
  o.iterations = 2;
  auto r = Simulate(p, TestDevice(), policy, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->fits) << r->failure;
  ASSERT_TRUE(offloaded);
  // The second iteration's first step reads the weight from the host (it
  // was made anew on the device, for free, before).
  EXPECT_EQ(r->h2d_bytes, 1000);
  EXPECT_EQ(r->reloads, 1);
  EXPECT_GE(r->stall_ns, 1000);
}

TEST(Simulator, DeltaMirrorsAWeightThatStartsTheNextIterationOnTheHost) {
  // At the last step only the updated weight can make room: delta offloads
  // it, and the next iteration reloads the weight from the host.
  const Program p = UpdatedWeightProgram(/*y_bytes=*/10);
  ASSERT_EQ(p.carries.size(), 1u);
  auto options = DynamicPolicyPreset("delta");
  ASSERT_TRUE(options.has_value());
  DynamicPolicy policy(*options);
  SimOptions o;
  o.budget_bytes = 1150;
  o.iterations = 2;
  auto r = Simulate(p, TestDevice(), policy, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->fits) << r->failure;
  EXPECT_GE(r->offloads, 1);
  EXPECT_GE(r->h2d_bytes, 1000);
  EXPECT_TRUE(policy.Consistency().ok()) << policy.Consistency();
}

// Layers of a heavy op, each followed by an in-place update of its output
// (a convolution and its ReLU_): the updated storage's rebuild must run the
// heavy op again, since the update took over the memory of what it read.
Trace HeavyOpThenInPlaceTrace(int layers) {
  TraceBuilder b("heavy-then-in-place");
  const int32_t x = b.Constant("x", 1000);
  std::vector<int32_t> act;
  int32_t prev = x;
  for (int i = 0; i < layers; ++i) {
    b.Op("conv", Phase::kForward, 40000).Input(prev);
    const int32_t y = b.Output(absl::StrCat("y", i), 1000);
    b.Op("relu_", Phase::kForward, 10).Input(y);
    prev = b.Version(y);
    act.push_back(prev);
  }
  int32_t grad = -1;
  for (int i = layers - 1; i >= 0; --i) {
    b.Op("conv_backward", Phase::kBackward, 1000).Input(act[i]);
    if (grad >= 0) b.Input(grad);
    const int32_t g = b.Output(absl::StrCat("g", i), 1000);
    if (grad >= 0) b.Release(grad);
    b.Release(act[i]);
    grad = g;
  }
  b.Release(grad);
  return std::move(b).Build();
}

TEST(Simulator, APolicySeesTheStorageAnInPlaceResultReplacesStillResident) {
  const Program p = Compiled(HeavyOpThenInPlaceTrace(2));
  const int32_t y0 = p.steps[0].creates[0];
  const int32_t updated = p.steps[1].creates[0];
  ASSERT_EQ(p.steps[1].in_place.size(), 1u);
  StorageState seen = StorageState::kAbsent;
  class Recording : public SimPolicy {
   public:
    Recording(int32_t watch, int32_t replaced, StorageState* seen)
        : watch_(watch), replaced_(replaced), seen_(seen) {}
    std::string name() const override { return "recording"; }
    void OnCreate(SimContext& ctx, int32_t s) override {
      if (s == watch_) *seen_ = ctx.state(replaced_);
    }
    bool MakeRoom(SimContext&, int64_t) override { return false; }

   private:
    int32_t watch_, replaced_;
    StorageState* seen_;
  } recording(updated, y0, &seen);
  SimOptions o;
  o.budget_bytes = p.peak_bytes;
  auto r = Simulate(p, TestDevice(), recording, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->fits) << r->failure;
  // What a rebuild of the result needs is still known when it is created.
  EXPECT_EQ(seen, StorageState::kResident);
}

TEST(Simulator, DeltaPricesAnInPlaceResultsRebuildWithTheOpBeforeIt) {
  // Each updated activation costs the heavy op to rebuild (40 us) against
  // about 18 us to copy out and back: delta offloads. Priced by the update
  // alone (10 ns), it would evict them and run the heavy ops again.
  const Program p = Compiled(HeavyOpThenInPlaceTrace(8));
  const SimResult r = RunPolicy(p, "delta", p.peak_bytes / 2);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_GT(r.offloads, 0);
  EXPECT_EQ(r.evictions, 0);
  EXPECT_EQ(r.recompute_ns, 0);
}

// The policy library's table mirrors every storage the simulator moves; a
// change it refuses means the two disagree (how a leak of rebuilt tensors
// once hid). Run every dynamic configuration on the chain and, where they
// are present, on two of DTR's measured logs at tight budgets.
TEST(Simulator, DynamicPoliciesMirrorEveryChangeWithoutARefusal) {
  std::vector<std::pair<std::string, Program>> programs;
  programs.emplace_back("chain", Compiled(ChainTrace(12, 1000, 1000)));
  for (const std::string& path : ListDtrLogs(DELTAD_DTR_TRACES)) {
    if (path.find("unet") == std::string::npos &&
        path.find("resnet32") == std::string::npos) {
      continue;
    }
    auto trace = ImportDtrLog(path);
    ASSERT_TRUE(trace.ok()) << trace.status();
    programs.emplace_back(path, Compiled(*trace));
  }
  if (programs.size() == 1) {
    std::cout << "[ NOTE     ] no DTR logs in " << DELTAD_DTR_TRACES
              << ": mirror checked on the chain trace only\n";
  } else {
    std::cout << "[ NOTE     ] mirror checked on " << programs.size()
              << " traces\n";
  }
  for (const auto& [name, program] : programs) {
    for (const char* preset : {"delta", "delta-paper", "delta-replay", "dtr",
                               "swap-lru", "delta-ahead"}) {
      for (double ratio : {0.3, 0.5}) {
        auto options = DynamicPolicyPreset(preset);
        ASSERT_TRUE(options.has_value()) << preset;
        DynamicPolicy policy(*options);
        SimOptions o;
        o.budget_bytes =
            std::max(program.min_budget_bytes,
                     static_cast<int64_t>(
                         ratio * static_cast<double>(program.peak_bytes)));
        o.iterations = IterationsFor(preset);
        auto r = Simulate(program, TestDevice(), policy, o);
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_TRUE(policy.Consistency().ok())
            << name << " " << preset << " at " << ratio << ": "
            << policy.Consistency();
        if (r->fits) {
          EXPECT_LE(r->peak_bytes, o.budget_bytes);
        }
      }
    }
  }
}

}  // namespace
}  // namespace deltad::sim
