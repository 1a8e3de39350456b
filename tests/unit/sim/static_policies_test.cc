// The registry of static baselines, and what every one of them guarantees:
// it fits where its plan suffices, says so where it does not, and replans
// each iteration.

#include "policies/sim/static_policies.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/lower_bounds.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"
#include "tests/unit/sim/static_policies_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;

bool IsSwap(absl::string_view policy) {
  return policy == "vdnn" || policy == "lms" || policy == "window" ||
         policy == "offload-greedy";
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
