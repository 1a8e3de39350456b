#ifndef DELTAD_TESTS_UNIT_SIM_STATIC_POLICIES_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_SIM_STATIC_POLICIES_TEST_HELPERS_H_

// What the tests of the static baselines share: two small training traces,
// a test device, and running a static policy while recording what it did.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"
#include "policies/sim/static_policies.h"
#include "policies/sim/trace.h"

namespace deltad::sim {

// 1 byte per ns each way by default: moving a tensor costs as long as
// making it.
inline DeviceProfile TestDevice(double h2d_bytes_per_s = 1e9,
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
inline Trace ConvChainTrace(int layers, int64_t bytes, int64_t time_ns,
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
inline Trace ResidualTrace(int blocks, int64_t bytes, int64_t time_ns) {
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

inline Program Compiled(const Trace& t) {
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
  Restore ChooseRestore(SimContext& ctx, int32_t s,
                        int64_t reload_ns) override {
    return inner_->ChooseRestore(ctx, s, reload_ns);
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

inline Outcome RunStatic(const Program& p, absl::string_view policy,
                         int64_t budget,
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

inline std::vector<int32_t> Storages(const std::vector<Event>& events) {
  std::vector<int32_t> out;
  for (const Event& e : events) out.push_back(e.storage);
  return out;
}

inline int32_t FirstBackwardStep(const Program& p) {
  for (size_t t = 0; t < p.steps.size(); ++t) {
    if (p.steps[t].phase == Phase::kBackward) return static_cast<int32_t>(t);
  }
  return static_cast<int32_t>(p.steps.size());
}

// A budget a fraction of the way from the least any policy needs to the
// peak.
inline int64_t Between(const Program& p, double fraction) {
  return p.min_budget_bytes +
         static_cast<int64_t>(
             fraction * static_cast<double>(p.peak_bytes - p.min_budget_bytes));
}

// The conv chain ("conv") or the residual trace, as the tests size them.
inline Program TraceFor(const std::string& trace) {
  if (trace == "conv") return Compiled(ConvChainTrace(12, 1000, 250, 1000));
  return Compiled(ResidualTrace(8, 1000, 1000));
}

}  // namespace deltad::sim

#endif  // DELTAD_TESTS_UNIT_SIM_STATIC_POLICIES_TEST_HELPERS_H_
