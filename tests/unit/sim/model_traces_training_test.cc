// The training step the traces model: gradient buffers, in-place updates,
// the optimizer's state, when values are released and what backward reads.

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/trace.h"
#include "tests/unit/sim/model_traces_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;
using Kind = TraceValue::Kind;

TEST(ModelTraces, EveryParameterHasAGradientBufferOfItsSize) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 1);
    for (const TraceValue& v : t.values) {
      if (!IsParameter(v)) continue;
      const TraceValue* grad = Find(t, v.name + ".grad");
      ASSERT_NE(grad, nullptr) << v.name;
      EXPECT_EQ(grad->bytes, v.bytes) << v.name;
    }
  }
}

// With gradient buffers kept between iterations (PyTorch 1.x's zero_grad).
TEST(ModelTraces, WeightsAndGradientsAreUpdatedInPlace) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    ModelOptions o;
    o.batch = 2;
    o.grads_set_to_none = false;
    const Trace t = Build(model, o);
    // The optimizer step: the ops after the last op of the backward pass.
    int32_t first_step = static_cast<int32_t>(t.ops.size());
    while (first_step > 0 && t.ops[first_step - 1].name == "optimizer_step") {
      --first_step;
    }
    ASSERT_LT(first_step, static_cast<int32_t>(t.ops.size()));
    std::map<int32_t, int> weight_versions;
    std::map<int32_t, int> grad_versions;
    for (const TraceValue& v : t.values) {
      if (v.kind != Kind::kVersion) continue;
      int32_t root = v.base;
      while (t.values[root].kind == Kind::kVersion) root = t.values[root].base;
      const TraceValue& r = t.values[root];
      if (IsParameter(r)) {
        ++weight_versions[root];
        EXPECT_GE(v.op, first_step) << r.name << " updated before the step";
        const std::vector<int32_t>& read = t.ops[v.op].inputs;
        EXPECT_NE(std::find(read.begin(), read.end(), root), read.end())
            << r.name << " updated by another weight's step";
      } else if (r.kind == Kind::kConstant && absl::EndsWith(r.name, ".grad")) {
        ++grad_versions[root];
        EXPECT_EQ(t.ops[v.op].phase, Phase::kBackward) << r.name;
        EXPECT_LT(v.op, first_step) << r.name;
      }
    }
    for (int32_t v = 0; v < static_cast<int32_t>(t.values.size()); ++v) {
      const TraceValue& value = t.values[v];
      if (IsParameter(value)) {
        EXPECT_EQ(weight_versions[v], 1) << value.name;
      } else if (value.kind == Kind::kConstant &&
                 absl::EndsWith(value.name, ".grad")) {
        // The tied GPT embedding collects from the LM head and the lookup.
        const int expected = value.name == "wte.weight.grad" ? 2 : 1;
        EXPECT_EQ(grad_versions[v], expected) << value.name;
      }
    }
    EXPECT_EQ(t.ops.back().phase, Phase::kBackward);
  }
}

// PyTorch 2's default: optimizer.zero_grad() sets the buffers to None, so
// the first backward op that reaches a parameter makes its gradient (the
// tied GPT embedding's second contribution adds to it in place), the step
// reads it, and it is gone by the end of the iteration; the peak is never
// higher than with buffers kept, and lower where the weights weigh.
TEST(ModelTraces, GradientsSetToNoneAreMadeInBackwardAndDroppedAfterTheStep) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    ModelOptions o;
    o.batch = 2;
    o.optimizer = Optimizer::kAdam;
    const Trace t = Build(model, o);
    int32_t first_step = static_cast<int32_t>(t.ops.size());
    while (first_step > 0 && t.ops[first_step - 1].name == "optimizer_step") {
      --first_step;
    }
    std::set<std::string> parameters;
    for (const TraceValue& v : t.values) {
      if (IsParameter(v)) parameters.insert(v.name);
    }
    std::map<std::string, int32_t> made;  // gradient name -> its first value
    for (int32_t v = 0; v < static_cast<int32_t>(t.values.size()); ++v) {
      const TraceValue& value = t.values[v];
      if (!absl::EndsWith(value.name, ".grad") ||
          !parameters.contains(
              value.name.substr(0, value.name.size() - sizeof(".grad") + 1))) {
        continue;
      }
      if (value.kind == Kind::kConstant) {
        ADD_FAILURE() << value.name << " is a constant";
        continue;
      }
      if (value.kind == Kind::kVersion) {
        EXPECT_EQ(value.name, "wte.weight.grad") << "accumulated in place";
        continue;
      }
      made.emplace(value.name, v);
      ASSERT_GE(value.op, 0) << value.name;
      EXPECT_EQ(t.ops[value.op].phase, Phase::kBackward) << value.name;
      EXPECT_LT(value.op, first_step) << value.name;
    }
    for (const std::string& name : parameters) {
      EXPECT_TRUE(made.contains(name + ".grad")) << name;
    }
    EXPECT_EQ(made.size(), parameters.size());
    // Gone by the end: the last ops' releases drop every gradient.
    std::set<int32_t> released;
    for (const TraceOp& op : t.ops) {
      released.insert(op.releases.begin(), op.releases.end());
    }
    for (const auto& [name, v] : made) {
      bool dropped = released.contains(v);
      for (int32_t w = v + 1;
           !dropped && w < static_cast<int32_t>(t.values.size()); ++w) {
        if (t.values[w].kind == Kind::kVersion && t.values[w].base == v) {
          dropped = released.contains(w);
        }
      }
      EXPECT_TRUE(dropped) << name << " outlives the iteration";
    }
    o.grads_set_to_none = false;
    const Trace kept = Build(model, o);
    EXPECT_LE(WalkLiveMemory(t).all, WalkLiveMemory(kept).all);
    if (model == "resnet50") {
      EXPECT_LT(WalkLiveMemory(t).all, WalkLiveMemory(kept).all);
    }
  }
}

TEST(ModelTraces, OptimizerNamesParseBackAndUnknownOnesAreRefused) {
  for (Optimizer o :
       {Optimizer::kSgd, Optimizer::kSgdMomentum, Optimizer::kAdam}) {
    absl::StatusOr<Optimizer> parsed = ParseOptimizer(OptimizerName(o));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, o);
  }
  absl::StatusOr<Optimizer> bad = ParseOptimizer("lamb");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'lamb'"));
  EXPECT_THAT(bad.status().message(), HasSubstr("adam"));
}

TEST(ModelTraces, OptimizerStateIsOneOrTwoCopiesOfEachWeightUpdatedByTheStep) {
  struct Case {
    Optimizer optimizer;
    std::vector<std::string> suffixes;
    const char* name;
  };
  for (const Case& c : {Case{Optimizer::kSgd, {}, "resnet50-b2-fp32"},
                        Case{Optimizer::kSgdMomentum,
                             {".momentum_buffer"},
                             "resnet50-b2-fp32-momentum"},
                        Case{Optimizer::kAdam,
                             {".exp_avg", ".exp_avg_sq"},
                             "resnet50-b2-fp32-adam"}}) {
    SCOPED_TRACE(c.name);
    ModelOptions o;
    o.batch = 2;
    o.optimizer = c.optimizer;
    const Trace t = Build("resnet50", o);
    EXPECT_EQ(t.name, c.name);
    const bool adam = c.optimizer == Optimizer::kAdam;
    // The step: Adam's square roots first, then one op per weight.
    std::vector<const TraceOp*> steps;
    const TraceOp* roots_op = nullptr;
    for (const TraceOp& op : t.ops) {
      if (op.name == "optimizer_step") steps.push_back(&op);
      if (op.name == "optimizer_step_sqrt") roots_op = &op;
    }
    ASSERT_FALSE(steps.empty());
    EXPECT_EQ(&t.ops.back(), steps.back());
    ASSERT_EQ(roots_op != nullptr, adam);
    int32_t roots = -1;
    if (adam) {
      ASSERT_EQ(roots_op->outputs.size(), 1u);
      roots = roots_op->outputs[0];
      EXPECT_LT(roots_op, steps.front());
    }
    int64_t weights = 0;
    int params = 0;
    for (const TraceValue& v : t.values) {
      if (!IsParameter(v)) continue;
      weights += v.bytes;
      ++params;
    }
    ASSERT_EQ(static_cast<int>(steps.size()), params);
    // Each weight's op reads that weight, its gradient and its own state
    // (and Adam's square roots), nothing of another weight's.
    int states = 0;
    double step_ns = 0;
    for (const TraceOp* op : steps) {
      step_ns += op->time_ns;
      std::string weight;
      for (int32_t v : op->inputs) {
        if (IsParameter(t.values[v])) {
          EXPECT_TRUE(weight.empty()) << "two weights in one op";
          weight = t.values[v].name;
        }
      }
      ASSERT_FALSE(weight.empty());
      std::set<std::string> read;
      for (int32_t v : op->inputs) {
        if (v == roots) continue;
        read.insert(t.values[v].name);
        EXPECT_TRUE(absl::StartsWith(t.values[v].name, weight))
            << t.values[v].name << " read by the step of " << weight;
      }
      EXPECT_TRUE(read.count(weight + ".grad")) << weight;
      for (const std::string& suffix : c.suffixes) {
        ASSERT_TRUE(read.count(weight + suffix)) << weight << suffix;
        EXPECT_EQ(BytesOf(t, weight + suffix), BytesOf(t, weight));
        ++states;
      }
      EXPECT_EQ(std::count(op->inputs.begin(), op->inputs.end(), roots),
                adam ? 1 : 0);
      EXPECT_EQ(op->workspace_bytes, 0);
    }
    EXPECT_EQ(states, params * static_cast<int>(c.suffixes.size()));
    // Traffic: the gradient, the weight and each state both ways, and
    // Adam's square roots read; making them reads exp_avg_sq and writes
    // them.
    const double bytes = (3.0 + 2.0 * c.suffixes.size() + (adam ? 1 : 0)) *
                         static_cast<double>(weights);
    EXPECT_NEAR(step_ns, bytes / A100().memory_bytes_per_s * 1e9,
                step_ns * 0.01 + 1000);
    if (adam) {
      // Adam's multi-tensor step makes the square roots of exp_avg_sq anew:
      // one weight's worth in all.
      EXPECT_EQ(t.values[roots].bytes, weights);
      EXPECT_NEAR(roots_op->time_ns,
                  2.0 * weights / A100().memory_bytes_per_s * 1e9,
                  roots_op->time_ns * 0.01 + 1000);
      EXPECT_EQ(roots_op->inputs.size(), static_cast<size_t>(params));
    }
  }
}

TEST(ModelTraces, ValuesAreReleasedRightAfterTheirLastUse) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 2);
    const size_t n = t.values.size();
    std::vector<int32_t> last_use(n, -1);
    std::vector<int32_t> released_at(n, -1);
    std::vector<bool> superseded(n, false);
    for (size_t i = 0; i < t.ops.size(); ++i) {
      for (int32_t v : t.ops[i].inputs) last_use[v] = static_cast<int32_t>(i);
      for (int32_t v : t.ops[i].releases) {
        EXPECT_EQ(released_at[v], -1) << t.values[v].name;
        released_at[v] = static_cast<int32_t>(i);
      }
    }
    for (const TraceValue& v : t.values) {
      if (v.kind == Kind::kVersion) superseded[v.base] = true;
    }
    EXPECT_TRUE(t.initial_releases.empty());
    for (size_t v = 0; v < n; ++v) {
      const TraceValue& value = t.values[v];
      size_t root = v;
      while (t.values[root].kind == Kind::kVersion) root = t.values[root].base;
      if (t.values[root].kind == Kind::kConstant || superseded[v]) {
        EXPECT_EQ(released_at[v], -1) << value.name << " must stay";
        continue;
      }
      EXPECT_EQ(released_at[v], std::max(value.op, last_use[v])) << value.name;
    }
    EXPECT_EQ(WalkLiveMemory(t).live_at_end, 0);
  }
}

TEST(ModelTraces, BackwardOpsReadWhatAutogradSaves) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 2);
    const std::vector<LayerPair> pairs = PairLayers(t);
    ASSERT_FALSE(pairs.empty());
    for (const auto& [f, b] : pairs) {
      SCOPED_TRACE(f->name);
      // What the backward op reads from the forward pass, parameters and
      // gradient buffers aside.
      std::set<int32_t> saved;
      for (int32_t v : b->inputs) {
        const TraceValue& value = t.values[v];
        const bool from_backward =
            value.op >= 0 && t.ops[value.op].phase == Phase::kBackward;
        if (!from_backward && !IsStateConstant(value)) saved.insert(v);
      }
      std::set<int32_t> expected;
      const std::string& op = f->name;
      if (op == "relu" || op == "softmax" || op == "log_softmax") {
        expected = {f->outputs[0]};  // the output
      } else if (op == "dropout") {
        expected = {f->outputs[1]};  // the mask only
        EXPECT_TRUE(absl::EndsWith(t.values[f->outputs[1]].name, ".mask"));
      } else if (op == "max_pool2d") {
        expected = {f->inputs[0], f->outputs[1]};  // input and indices
      } else if (op == "batch_norm" || op == "layer_norm") {
        expected = {f->inputs[0], f->outputs[1]};  // input and statistics
      } else if (op == "matmul" || op == "nll_loss") {
        expected = {f->inputs[0], f->inputs[1]};
      } else if (op == "embedding") {
        expected = {f->inputs[1]};  // the indices
      } else if (op == "cat" || op == "split") {
        expected = {};  // slicing or concatenating the gradient needs none
      } else {
        // conv2d, conv_transpose2d, linear, gelu and the pools: the input.
        expected = {f->inputs[0]};
      }
      EXPECT_EQ(saved, expected);
    }
  }
}

}  // namespace
}  // namespace deltad::sim
