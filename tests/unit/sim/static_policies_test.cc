#include "policies/sim/static_policies.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/checkpoint_policies.h"
#include "policies/sim/lower_bounds.h"
#include "policies/sim/program.h"
#include "policies/sim/program_analysis.h"
#include "policies/sim/simulator.h"
#include "policies/sim/swap_policies.h"
#include "policies/sim/trace.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAreArray;

// 1 byte per ns each way by default: moving a tensor costs as long as
// making it.
DeviceProfile TestDevice(double h2d_bytes_per_s = 1e9,
                         double d2h_bytes_per_s = 1e9) {
  DeviceProfile d;
  d.name = "test";
  d.memory_bytes = int64_t{1} << 30;
  d.h2d_bytes_per_s = h2d_bytes_per_s;
  d.d2h_bytes_per_s = d2h_bytes_per_s;
  d.copy_engines = 2;
  return d;
}

// A convolutional chain: each layer is conv2d then relu. conv2d reads the
// previous relu's output (the network input for the first), and its
// backward reads that input again; relu's backward reads the conv output.
// So the saved activations are c0, r0, c1, r1, ... and the conv inputs
// among them are r0 .. r(L-2). Convolutions take `conv_ns`, the rest
// `time_ns`.
Trace ConvChainTrace(int layers, int64_t bytes, int64_t time_ns,
                     int64_t conv_ns) {
  TraceBuilder b("conv-chain");
  const int32_t x = b.Constant("x", bytes);
  std::vector<int32_t> w;
  for (int i = 0; i < layers; ++i) {
    w.push_back(b.Constant(absl::StrCat("w", i), 64));
  }
  std::vector<int32_t> in;  // conv inputs
  std::vector<int32_t> c;   // conv outputs
  std::vector<int32_t> r;   // relu outputs
  int32_t prev = x;
  for (int i = 0; i < layers; ++i) {
    in.push_back(prev);
    b.Op("conv2d", Phase::kForward, conv_ns).Input(prev).Input(w[i]);
    c.push_back(b.Output(absl::StrCat("c", i), bytes));
    b.Op("relu", Phase::kForward, time_ns).Input(c[i]);
    r.push_back(b.Output(absl::StrCat("r", i), bytes));
    prev = r[i];
  }
  b.Op("loss", Phase::kForward, time_ns).Input(prev);
  const int32_t loss = b.Output("loss", 8);
  b.Op("loss_backward", Phase::kBackward, time_ns).Input(loss).Input(prev);
  int32_t grad = b.Output("g_loss", bytes);
  b.Release(loss);
  b.Release(prev);
  for (int i = layers - 1; i >= 0; --i) {
    b.Op("relu_backward", Phase::kBackward, time_ns).Input(grad).Input(c[i]);
    const int32_t gc = b.Output(absl::StrCat("gc", i), bytes);
    b.Release(grad);
    b.Release(c[i]);
    b.Op("conv_backward", Phase::kBackward, conv_ns)
        .Input(gc)
        .Input(in[i])
        .Input(w[i]);
    grad = b.Output(absl::StrCat("gin", i), bytes);
    b.Version(w[i]);
    b.Release(gc);
    if (i > 0) b.Release(in[i]);
  }
  b.Release(grad);
  return std::move(b).Build();
}

// Residual blocks: h = linear(in), o = linear(h), out = in + o. The block
// input is read by the first linear and again by the add (a skip
// connection), and saved for the first linear's backward; h is saved for
// the second's.
Trace ResidualTrace(int blocks, int64_t bytes, int64_t time_ns) {
  TraceBuilder b("residual");
  const int32_t x = b.Constant("x", bytes);
  std::vector<int32_t> w1, w2, in, h;
  int32_t prev = x;
  for (int i = 0; i < blocks; ++i) {
    w1.push_back(b.Constant(absl::StrCat("w1_", i), 64));
    w2.push_back(b.Constant(absl::StrCat("w2_", i), 64));
  }
  for (int i = 0; i < blocks; ++i) {
    in.push_back(prev);
    b.Op("linear", Phase::kForward, time_ns).Input(prev).Input(w1[i]);
    h.push_back(b.Output(absl::StrCat("h", i), bytes));
    b.Op("linear", Phase::kForward, time_ns).Input(h[i]).Input(w2[i]);
    const int32_t o = b.Output(absl::StrCat("o", i), bytes);
    b.Op("add", Phase::kForward, time_ns / 4).Input(o).Input(prev);
    prev = b.Output(absl::StrCat("out", i), bytes);
    b.Release(o);
  }
  b.Op("loss", Phase::kForward, time_ns / 4).Input(prev);
  const int32_t loss = b.Output("loss", 8);
  b.Release(prev);
  b.Op("loss_backward", Phase::kBackward, time_ns / 4).Input(loss);
  int32_t grad = b.Output("g_loss", bytes);
  b.Release(loss);
  for (int i = blocks - 1; i >= 0; --i) {
    b.Op("linear_backward", Phase::kBackward, time_ns)
        .Input(grad)
        .Input(h[i])
        .Input(w2[i]);
    const int32_t gh = b.Output(absl::StrCat("gh", i), bytes);
    b.Version(w2[i]);
    b.Release(h[i]);
    b.Op("linear_backward", Phase::kBackward, time_ns)
        .Input(gh)
        .Input(in[i])
        .Input(w1[i]);
    const int32_t gx = b.Output(absl::StrCat("gx", i), bytes);
    b.Version(w1[i]);
    b.Release(gh);
    if (i > 0) b.Release(in[i]);
    b.Op("add", Phase::kBackward, time_ns / 4).Input(gx).Input(grad);
    const int32_t g = b.Output(absl::StrCat("gin", i), bytes);
    b.Release(gx);
    b.Release(grad);
    grad = g;
  }
  b.Release(grad);
  return std::move(b).Build();
}

Program Compiled(const Trace& t) {
  auto p = Compile(t);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : Program{};
}

struct Event {
  int32_t storage;
  int32_t step;
};

// Forwards every callback to a static policy and records what it did.
class Recorder final : public SimPolicy {
 public:
  explicit Recorder(std::unique_ptr<SimPolicy> inner)
      : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  void BeginIteration(SimContext& ctx) override { inner_->BeginIteration(ctx); }
  void BeforeStep(SimContext& ctx, int32_t step) override {
    inner_->BeforeStep(ctx, step);
  }
  void AfterStep(SimContext& ctx, int32_t step) override {
    inner_->AfterStep(ctx, step);
  }
  void OnCreate(SimContext& ctx, int32_t s) override {
    inner_->OnCreate(ctx, s);
  }
  void OnAccess(SimContext& ctx, int32_t s) override {
    inner_->OnAccess(ctx, s);
  }
  void OnStateChange(SimContext& ctx, int32_t s, StorageState from,
                     StorageState to) override {
    if (to == StorageState::kOffloading) offloaded.push_back({s, ctx.step()});
    if (to == StorageState::kEvicted) evicted.push_back({s, ctx.step()});
    inner_->OnStateChange(ctx, s, from, to);
  }
  bool MakeRoom(SimContext& ctx, int64_t bytes) override {
    ++make_room_calls;
    return inner_->MakeRoom(ctx, bytes);
  }
  Restore ChooseRestore(SimContext& ctx, int32_t s) override {
    return inner_->ChooseRestore(ctx, s);
  }

  std::vector<Event> offloaded;
  std::vector<Event> evicted;
  int make_room_calls = 0;

 private:
  std::unique_ptr<SimPolicy> inner_;
};

struct Outcome {
  SimResult result;
  std::vector<Event> offloaded;
  std::vector<Event> evicted;
  int make_room_calls = 0;
};

Outcome RunStatic(const Program& p, absl::string_view policy, int64_t budget,
                  const DeviceProfile& device = TestDevice()) {
  auto made = MakeStaticPolicy(policy);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return {};
  Recorder recorder(std::move(*made));
  SimOptions o;
  o.budget_bytes = budget;
  auto r = Simulate(p, device, recorder, o);
  EXPECT_TRUE(r.ok()) << r.status();
  Outcome run;
  if (r.ok()) run.result = *r;
  run.offloaded = recorder.offloaded;
  run.evicted = recorder.evicted;
  run.make_room_calls = recorder.make_room_calls;
  return run;
}

std::vector<int32_t> Storages(const std::vector<Event>& events) {
  std::vector<int32_t> out;
  for (const Event& e : events) out.push_back(e.storage);
  return out;
}

int32_t StorageNamed(const Program& p, absl::string_view name) {
  for (size_t s = 0; s < p.storages.size(); ++s) {
    if (p.storages[s].name == name) return static_cast<int32_t>(s);
  }
  ADD_FAILURE() << "no storage " << name;
  return -1;
}

int32_t FirstBackwardStep(const Program& p) {
  for (size_t t = 0; t < p.steps.size(); ++t) {
    if (p.steps[t].phase == Phase::kBackward) return static_cast<int32_t>(t);
  }
  return static_cast<int32_t>(p.steps.size());
}

bool IsSwap(absl::string_view policy) {
  return policy == "vdnn" || policy == "lms" || policy == "window" ||
         policy == "offload-greedy";
}

// A budget a fraction of the way from the least any policy needs to the
// peak.
int64_t Between(const Program& p, double fraction) {
  return p.min_budget_bytes +
         static_cast<int64_t>(
             fraction * static_cast<double>(p.peak_bytes - p.min_budget_bytes));
}

TEST(StaticPolicies, NamesAreUniqueAndEachIsMade) {
  const std::vector<std::string> names = StaticPolicyNames();
  EXPECT_EQ(names.size(), 6u);
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(),
            names.size());
  for (const std::string& name : names) {
    auto made = MakeStaticPolicy(name);
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_EQ((*made)->name(), name);
  }
}

TEST(StaticPolicies, UnknownNameIsAnError) {
  auto made = MakeStaticPolicy("belady");
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(made.status().message(), HasSubstr("offload-greedy"));
}

TEST(StaticPolicies, SavedActivationsAreForwardOutputsReadInBackward) {
  const Program p = Compiled(ConvChainTrace(3, 1000, 100, 400));
  std::vector<int32_t> expected;
  for (const char* name : {"c0", "r0", "c1", "r1", "c2", "r2", "loss"}) {
    expected.push_back(StorageNamed(p, name));
  }
  EXPECT_THAT(SavedActivations(p), ElementsAreArray(expected));
  // The last block's output is read by the loss only; the loss itself is
  // read again by its backward.
  const Program r = Compiled(ResidualTrace(2, 1000, 100));
  std::vector<int32_t> residual;
  for (const char* name : {"h0", "out0", "h1", "loss"}) {
    residual.push_back(StorageNamed(r, name));
  }
  EXPECT_THAT(SavedActivations(r), ElementsAreArray(residual));
}

struct Case {
  std::string policy;
  std::string trace;
  double fraction;  // of the way from min_budget_bytes to the peak
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string name = absl::StrCat(info.param.policy, "_", info.param.trace, "_",
                                  std::lround(info.param.fraction * 100));
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

Program TraceFor(const std::string& trace) {
  if (trace == "conv") return Compiled(ConvChainTrace(12, 1000, 250, 1000));
  return Compiled(ResidualTrace(8, 1000, 1000));
}

class EveryStaticPolicy : public ::testing::TestWithParam<Case> {};

TEST_P(EveryStaticPolicy, FitsWithinBudgetAndAccountsTime) {
  const Case& c = GetParam();
  const Program p = TraceFor(c.trace);
  const int64_t budget = Between(p, c.fraction);
  ASSERT_GE(budget, p.min_budget_bytes);
  ASSERT_LT(budget, p.peak_bytes);
  const Outcome run = RunStatic(p, c.policy, budget);
  const SimResult& r = run.result;
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_LE(r.peak_bytes, budget);
  EXPECT_GE(r.makespan_ns, p.compute_ns);
  EXPECT_EQ(r.makespan_ns, p.compute_ns + r.recompute_ns + r.stall_ns);
  if (IsSwap(c.policy)) {
    EXPECT_EQ(r.evictions + r.recomputes + r.recompute_ns, 0);
    EXPECT_GT(r.offloads, 0);
    EXPECT_LE(r.h2d_bytes, r.d2h_bytes);
    const LowerBounds lb = ComputeLowerBounds(p, TestDevice(), budget);
    EXPECT_GE(r.makespan_ns, lb.swap_only_ns);
  } else {
    EXPECT_EQ(r.d2h_bytes + r.h2d_bytes + r.offloads + r.reloads, 0);
    EXPECT_GT(r.evictions, 0);
    EXPECT_GT(r.recomputes, 0);
  }
}

// Budgets where each plan suffices. vDNN releases convolution inputs only:
// about half of what the conv chain saves, and nothing of the residual
// trace (no convolutions). Checkpointing needs room to rebuild a segment.
std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const std::string& policy : StaticPolicyNames()) {
    for (const char* trace : {"conv", "residual"}) {
      std::vector<double> fractions = {0.3, 0.6, 0.9};
      if (policy == "vdnn") {
        if (std::string(trace) != "conv") continue;
        fractions = {0.6, 0.9};
      } else if (!IsSwap(policy)) {
        fractions = {0.5, 0.8};
      }
      for (double fraction : fractions) {
        cases.push_back({policy, trace, fraction});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Plans, EveryStaticPolicy,
                         ::testing::ValuesIn(AllCases()), CaseName);

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

TEST(StaticPolicies, ReportOutOfMemoryWhenThePlanCannotMakeRoom) {
  // vDNN releases convolution inputs only; at the least budget the
  // convolution outputs alone overflow it, and it says so.
  const Program conv = TraceFor("conv");
  const Outcome low = RunStatic(conv, "vdnn", conv.min_budget_bytes);
  EXPECT_FALSE(low.result.fits);
  EXPECT_THAT(low.result.failure, HasSubstr("out of memory"));
  // Without convolutions it has nothing to release at all.
  const Program residual = TraceFor("residual");
  const Outcome none = RunStatic(residual, "vdnn", residual.peak_bytes - 1);
  EXPECT_FALSE(none.result.fits);
  EXPECT_TRUE(none.offloaded.empty());
  // Checkpointing cannot go below what rebuilding a segment needs.
  for (const char* policy : {"chen-sqrt", "chen-greedy"}) {
    const Outcome run = RunStatic(conv, policy, conv.min_budget_bytes);
    EXPECT_FALSE(run.result.fits) << policy;
    EXPECT_EQ(run.result.d2h_bytes, 0) << policy;
  }
}

TEST(StaticPolicies, ReplanEachIteration) {
  const Program p = TraceFor("conv");
  for (const std::string& name : StaticPolicyNames()) {
    auto made = MakeStaticPolicy(name);
    ASSERT_TRUE(made.ok());
    SimOptions o;
    o.budget_bytes = Between(p, 0.8);
    o.iterations = 1;
    auto one = Simulate(p, TestDevice(), **made, o);
    auto again = MakeStaticPolicy(name);
    ASSERT_TRUE(again.ok());
    o.iterations = 3;
    auto three = Simulate(p, TestDevice(), **again, o);
    ASSERT_TRUE(one.ok() && three.ok());
    ASSERT_TRUE(one->fits && three->fits) << name;
    EXPECT_EQ(three->recompute_ns, one->recompute_ns) << name;
    EXPECT_EQ(three->d2h_bytes, one->d2h_bytes) << name;
    EXPECT_LE(three->peak_bytes, o.budget_bytes) << name;
  }
}

}  // namespace
}  // namespace deltad::sim
