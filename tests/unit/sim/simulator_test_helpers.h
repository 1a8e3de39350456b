#ifndef DELTAD_TESTS_UNIT_SIM_SIMULATOR_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_SIM_SIMULATOR_TEST_HELPERS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"
#include "policies/sim/trace.h"

namespace deltad::sim::testing_util {

// 1 byte per ns each way: moving a tensor costs as long as making it.
inline DeviceProfile TestDevice(int copy_engines = 2) {
  DeviceProfile d;
  d.name = "test";
  d.memory_bytes = int64_t{1} << 30;
  d.h2d_bytes_per_s = 1e9;
  d.d2h_bytes_per_s = 1e9;
  d.copy_engines = copy_engines;
  return d;
}

// A training iteration of a chain: input x, L layers each saving its
// output for backward, then backward in reverse releasing each activation
// after its last use. `heavy` makes recompute dearer than a copy.
inline Trace ChainTrace(int layers, int64_t bytes, int64_t time_ns,
                        bool heavy = false) {
  TraceBuilder b("chain");
  const int32_t x = b.Constant("x", bytes);
  std::vector<int32_t> w;
  for (int i = 0; i < layers; ++i) {
    w.push_back(b.Constant(absl::StrCat("w", i), 64));
  }
  std::vector<int32_t> act;
  int32_t prev = x;
  for (int i = 0; i < layers; ++i) {
    b.Op("linear", Phase::kForward, heavy ? 4 * time_ns : time_ns)
        .Input(prev)
        .Input(w[i]);
    prev = b.Output(absl::StrCat("a", i), bytes);
    act.push_back(prev);
  }
  int32_t grad = -1;
  for (int i = layers - 1; i >= 0; --i) {
    b.Op("linear_backward", Phase::kBackward, time_ns).Input(act[i]);
    if (grad >= 0) b.Input(grad);
    const int32_t g = b.Output(absl::StrCat("g", i), bytes);
    b.Version(w[i]);
    if (grad >= 0) b.Release(grad);
    b.Release(act[i]);
    grad = g;
  }
  b.Release(grad);
  return std::move(b).Build();
}

inline SimResult RunPolicy(const Program& p, absl::string_view policy,
                           int64_t budget,
                           AllocatorKind alloc = AllocatorKind::kExact,
                           int copy_engines = 2) {
  auto made = MakePolicy(policy);
  EXPECT_TRUE(made.ok()) << made.status();
  SimOptions o;
  o.budget_bytes = budget;
  o.allocator = alloc;
  o.iterations = IterationsFor(policy);
  const DeviceProfile d = TestDevice(copy_engines);
  auto r = Simulate(p, d, **made, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : SimResult{};
}

inline Program Compiled(const Trace& t) {
  auto p = Compile(t);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

// A policy whose steps, releases and restores a test scripts; by itself it
// releases nothing and reloads what it must restore.
class Scripted final : public SimPolicy {
 public:
  std::function<void(SimContext&, int32_t)> after_step;
  std::function<bool(SimContext&, int64_t)> make_room;
  std::function<Restore(int64_t reload_ns)> restore;
  std::vector<int32_t> copies_dropped;  // OnHostCopyDropped's, in order
  std::string name() const override { return "scripted"; }
  void OnHostCopyDropped(SimContext&, int32_t s) override {
    copies_dropped.push_back(s);
  }
  void AfterStep(SimContext& ctx, int32_t step) override {
    if (after_step) after_step(ctx, step);
  }
  bool MakeRoom(SimContext& ctx, int64_t bytes) override {
    return make_room && make_room(ctx, bytes);
  }
  Restore ChooseRestore(SimContext&, int32_t, int64_t reload_ns) override {
    return restore ? restore(reload_ns) : Restore::kReload;
  }
};

// 4 layers of 1000-byte activations (or `bytes`), 1000 ns a step, 1 byte
// per ns each way: a copy of 1000 bytes takes one step. Forward steps 0-3
// make a0-a3; backward steps 4-7 read a3..a0 and make g3..g0. a0 is last
// read in the forward pass by step 1, and again by step 7.
struct ScriptedChain {
  explicit ScriptedChain(int64_t bytes = 1000)
      : program(Compiled(ChainTrace(4, bytes, 1000))) {}
  Program program;
  int32_t a0 = program.steps[0].creates[0];
  SimResult Go(SimPolicy& policy, int64_t budget = int64_t{1} << 30,
               int64_t host_bytes = int64_t{1} << 40) {
    SimOptions o;
    o.budget_bytes = budget;
    o.host_bytes = host_bytes;
    auto r = Simulate(program, TestDevice(), policy, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : SimResult{};
  }
};

}  // namespace deltad::sim::testing_util

#endif  // DELTAD_TESTS_UNIT_SIM_SIMULATOR_TEST_HELPERS_H_
