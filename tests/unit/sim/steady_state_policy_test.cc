#include "policies/sim/steady_state_policy.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/random_graphs.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {
namespace {

// A model trace on the A100 profile, by default U-Net at batch 2 and 0.6
// of its peak, where a static plan beats delta, deciding online.
struct Net {
  DeviceProfile device = *FindDeviceProfile("a100-80gb");
  Program program;
  SimOptions options;
  Net() {
    ModelOptions o;
    o.batch = 2;
    program = *Compile(*BuildModelTrace("unet", o, device));
    options.budget_bytes = program.peak_bytes * 6 / 10;
  }
  SimResult Run(SimPolicy& policy, int iterations) const {
    SimOptions o = options;
    o.iterations = iterations;
    absl::StatusOr<SimResult> r = Simulate(program, device, policy, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : SimResult{};
  }
};

// `model` at batch 32 with Adam at half its peak, as in the bench's
// steady-state section.
Net AdamAtHalf(const char* model) {
  Net net;
  ModelOptions o;
  o.optimizer = Optimizer::kAdam;
  net.program = *Compile(*BuildModelTrace(model, o, net.device));
  net.options.budget_bytes = net.program.peak_bytes / 2;
  return net;
}

TEST(SteadyStatePolicy, FollowsDeltaInTheFirstIterationAndPlansNothingYet) {
  Net net;
  SteadyStatePolicy steady;
  const SimResult r = net.Run(steady, 1);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(steady.following(), "delta");
  EXPECT_EQ(r.planning_ns, 0);
  auto delta = MakePolicy("delta");
  const SimResult d = net.Run(**delta, 1);
  EXPECT_EQ(r.makespan_ns, d.makespan_ns);
}

TEST(SteadyStatePolicy, FromTheSecondIterationFollowsTheFastestReplay) {
  Net net;
  SteadyStatePolicy steady;
  const SimResult r = net.Run(steady, 3);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_GT(r.planning_ns, 0);
  // The plan whose third of three iterations is fastest, each run alone as
  // the replays run it (delta first: a tie keeps it).
  std::string fastest = "delta";
  int64_t best = net.Run(**MakePolicy("delta"), 3).makespan_ns;
  for (const char* name :
       {"window", "offload-greedy", "delta-replay", "dtr", "delta-paper"}) {
    const SimResult c = net.Run(**MakePolicy(name), 3);
    if (c.fits && c.makespan_ns < best) {
      best = c.makespan_ns;
      fastest = name;
    }
  }
  EXPECT_NE(fastest, "delta");
  EXPECT_EQ(steady.following(), fastest);
  EXPECT_EQ(steady.abandoned(), 0);
  // The third iteration runs the plan as fast as the plan runs its own
  // third (later iterations start from what earlier ones left offloaded),
  // within 1%.
  const SimResult alone = net.Run(**MakePolicy(fastest), 3);
  EXPECT_LE(r.makespan_ns, alone.makespan_ns * 101 / 100);
  // And over the three iterations, faster than delta.
  const SimResult d = net.Run(**MakePolicy("delta"), 3);
  EXPECT_LT(r.total_makespan_ns, d.total_makespan_ns);
  EXPECT_EQ(r.iterations, 3);
}

TEST(SteadyStatePolicy, APlanThatRunsInTheIdealTimeEndsTheSearch) {
  // U-Net at batch 32 with Adam at half its peak: the static offload plan
  // hides every copy (docs/BENCHMARKS.md), and the candidates after the
  // first plan that reaches the ideal time are not replayed (on one
  // thread: on more, those already running finish).
  const Net net = AdamAtHalf("unet");
  SteadyStatePolicy steady(1);
  SimResult r = net.Run(steady, 2);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.makespan_ns, net.program.compute_ns);
  // delta, window, then offload-greedy, and none of the three after it.
  EXPECT_EQ(steady.following(), "offload-greedy");
  EXPECT_EQ(steady.replayed(), 3);
}

TEST(SteadyStatePolicy, IterationsInTheIdealTimeLeaveNothingToPlan) {
  // With the whole peak, delta's iterations are ideal: nothing is
  // replayed, and there is nothing to follow but delta.
  Net roomy;
  roomy.options.budget_bytes = roomy.program.peak_bytes;
  SteadyStatePolicy unplanned;
  const SimResult r = roomy.Run(unplanned, 3);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.total_makespan_ns, 3 * roomy.program.compute_ns);
  EXPECT_EQ(unplanned.replayed(), 0);
  EXPECT_EQ(r.planning_ns, 0);
  EXPECT_EQ(unplanned.following(), "delta");
}

// The replays run on several threads at once; which finishes first
// changes which give up early, never the plan chosen or the run.
TEST(SteadyStatePolicy, ThePlanChosenIsTheSameOnAnyNumberOfThreads) {
  std::vector<Net> nets = {Net(), AdamAtHalf("resnet50"), AdamAtHalf("unet")};
  for (const Net& net : nets) {
    SteadyStatePolicy one(1);
    const SimResult a = net.Run(one, 3);
    for (int threads : {2, 7}) {
      SteadyStatePolicy several(threads);
      const SimResult b = net.Run(several, 3);
      EXPECT_EQ(several.following(), one.following()) << threads;
      EXPECT_EQ(b.total_makespan_ns, a.total_makespan_ns) << threads;
      EXPECT_EQ(b.fits, a.fits);
      EXPECT_GT(b.planning_cpu_ns, 0);
    }
  }
}

// ResNet-50 with Adam at half its peak: the plan chosen (DELTA as
// published) releases parameters and optimizer state too, which the first
// iteration left in place; following it, an iteration takes what it takes
// in the plan's own run, as its replay predicted.
TEST(SteadyStatePolicy, TheFollowedPlanSeesWhatTheFirstIterationLeftInPlace) {
  const Net net = AdamAtHalf("resnet50");
  SteadyStatePolicy steady;
  const SimResult r = net.Run(steady, 3);
  ASSERT_TRUE(r.fits) << r.failure;
  ASSERT_NE(steady.following(), "delta");
  const SimResult alone = net.Run(**MakePolicy(steady.following()), 3);
  ASSERT_TRUE(alone.fits) << alone.failure;
  EXPECT_LE(r.makespan_ns, alone.makespan_ns * 1005 / 1000)
      << steady.following();
}

// Stands in for the simulator where only the accesses matter: a plan is
// made on the recorded program, then the accesses go another way. Its clock
// stands where the first iteration under `delta` ended (`now_ns`), the time
// the plans must beat.
class AccessesOnly final : public SimContext {
 public:
  AccessesOnly(const Net& net, int64_t now_ns) : net_(net), now_ns_(now_ns) {}
  const Program& program() const override { return net_.program; }
  const DeviceProfile& device() const override { return net_.device; }
  int64_t now_ns() const override { return now_ns_; }
  void set_now_ns(int64_t now_ns) { now_ns_ = now_ns; }
  int32_t step() const override { return 0; }
  int iteration() const override { return 0; }
  StorageState state(int32_t) const override { return StorageState::kAbsent; }
  bool locked(int32_t) const override { return false; }
  const std::vector<int32_t>& locked_storages() const override { return none_; }
  int64_t budget() const override { return net_.options.budget_bytes; }
  const SimOptions& options() const override { return net_.options; }
  int64_t device_used() const override { return 0; }
  int64_t releasing_bytes() const override { return 0; }
  int64_t host_free() const override { return net_.options.host_bytes; }
  int reloads_in_flight() const override { return 0; }
  int64_t d2h_free_at() const override { return 0; }
  HostCopy host_copy(int32_t) const override { return HostCopy::kNone; }
  bool CanEvict(int32_t) const override { return false; }
  bool Offload(int32_t) override { return false; }
  bool Evict(int32_t) override { return false; }
  bool Prefetch(int32_t) override { return false; }
  bool CopyAhead(int32_t) override { return false; }

 private:
  const Net& net_;
  int64_t now_ns_;
  std::vector<int32_t> none_;
};

TEST(SteadyStatePolicy, AnAccessOffTheRecordingAbandonsThePlanAtOnce) {
  Net net;
  AccessesOnly ctx(net, 0);
  SteadyStatePolicy steady;
  steady.BeginIteration(ctx);
  for (int32_t s : {3, 4, 5, 6}) steady.OnAccess(ctx, s);
  // The first iteration took as long as delta's, more than the ideal.
  ctx.set_now_ns(net.Run(**MakePolicy("delta"), 1).makespan_ns);
  ASSERT_GT(ctx.now_ns(), net.program.compute_ns);
  steady.BeginIteration(ctx);  // plans on the program
  ASSERT_NE(steady.following(), "delta");
  steady.OnAccess(ctx, 3);
  steady.OnAccess(ctx, 4);
  EXPECT_NE(steady.following(), "delta");
  steady.OnAccess(ctx, 7);  // not 5: the iteration went another way
  EXPECT_EQ(steady.following(), "delta");
  EXPECT_EQ(steady.abandoned(), 1);
  steady.OnAccess(ctx, 6);  // delta decides from here on
  EXPECT_EQ(steady.abandoned(), 1);
}

// Random graph 2 at half its peak: prefetching in the order the first
// iteration read is what replays fastest; the plan followed is `delta` doing
// that, and the second iteration beats plain `delta`'s. `delta` itself
// turns to it, keeping what it learnt: the iterations run exactly as
// delta-replay's own from the start (a new delta-replay had run them up to
// 2.6% slower on the bench's random graphs).
TEST(SteadyStatePolicy, ItPrefetchesInTheRecordedOrderWhereThatReplaysFaster) {
  Net net;
  net.program = *Compile(RandomLayerGraph(2));
  net.options.budget_bytes = net.program.peak_bytes / 2;
  SteadyStatePolicy steady;
  const SimResult r = net.Run(steady, 4);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(steady.following(), "delta-replay");
  const SimResult delta = net.Run(**MakePolicy("delta"), 4);
  EXPECT_LT(r.makespan_ns, delta.makespan_ns);
  const SimResult replay = net.Run(**MakePolicy("delta-replay"), 4);
  EXPECT_EQ(r.total_makespan_ns, replay.total_makespan_ns);
}

// Random graph 7 at 0.4 of its peak over five iterations (the bench's
// cell): replayed once from nothing, DELTA as published looked fastest and
// then ran its iterations 6% slower than delta-replay. Judged by the third
// of three replayed iterations, the plan followed runs the five no slower
// than any candidate alone.
TEST(SteadyStatePolicy, PlansAreJudgedByTheIterationsThatFollowTheFirst) {
  Net net;
  net.program = *Compile(RandomLayerGraph(7));
  auto peak = UnlimitedPeak(net.program, net.device, AllocatorKind::kExact, 5);
  ASSERT_TRUE(peak.ok()) << peak.status();
  net.options.budget_bytes = *peak * 4 / 10;
  SteadyStatePolicy steady;
  const SimResult r = net.Run(steady, 5);
  ASSERT_TRUE(r.fits) << r.failure;
  for (const char* name : {"delta", "delta-replay", "delta-paper"}) {
    const SimResult alone = net.Run(**MakePolicy(name), 5);
    ASSERT_TRUE(alone.fits) << name << ": " << alone.failure;
    EXPECT_LE(r.total_makespan_ns, alone.total_makespan_ns * 1005 / 1000)
        << "following " << steady.following() << ", against " << name;
  }
}

// DenseNet-121 with Adam at 0.4 of its peak: prefetching in the recorded
// order would be slower than `delta` here, and nothing else beats it either.
// As the fallback it had made the two iterations 9% slower than `delta`'s
// (2.119 against 1.946 times the ideal); checked by its replay, it is not
// taken.
TEST(SteadyStatePolicy, WhereNoPlanReplaysFasterItKeepsDelta) {
  Net net = AdamAtHalf("densenet121");
  net.options.budget_bytes = net.program.peak_bytes * 4 / 10;
  SteadyStatePolicy steady;
  const SimResult r = net.Run(steady, 2);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(steady.following(), "delta");
  const SimResult delta = net.Run(**MakePolicy("delta"), 2);
  ASSERT_TRUE(delta.fits) << delta.failure;
  EXPECT_LE(r.total_makespan_ns, delta.total_makespan_ns * 1005 / 1000);
}

}  // namespace
}  // namespace deltad::sim
