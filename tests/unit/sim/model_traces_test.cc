#include "policies/sim/model_traces.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/trace.h"
#include "policies/sim/trace_io.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Kind = TraceValue::Kind;

constexpr int64_t kMiB = int64_t{1} << 20;

DeviceProfile A100() {
  absl::StatusOr<DeviceProfile> p = FindDeviceProfile("a100-80gb");
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

Trace Build(const std::string& model, ModelOptions options,
            const DeviceProfile& device = A100()) {
  absl::StatusOr<Trace> trace = BuildModelTrace(model, options, device);
  EXPECT_TRUE(trace.ok()) << model << ": " << trace.status();
  return trace.ok() ? *std::move(trace) : Trace{};
}

Trace Build(const std::string& model, int batch, DType dtype = DType::kFp32) {
  ModelOptions options;
  options.batch = batch;
  options.dtype = dtype;
  return Build(model, options);
}

// The value that `name` last referred to (versions repeat the name).
const TraceValue* Find(const Trace& trace, const std::string& name) {
  for (auto it = trace.values.rbegin(); it != trace.values.rend(); ++it) {
    if (it->name == name) return &*it;
  }
  return nullptr;
}

int64_t BytesOf(const Trace& trace, const std::string& name) {
  const TraceValue* v = Find(trace, name);
  EXPECT_NE(v, nullptr) << "no value named '" << name << "' in " << trace.name;
  return v == nullptr ? -1 : v->bytes;
}

bool IsParameter(const TraceValue& v) {
  return v.kind == Kind::kConstant &&
         (absl::EndsWith(v.name, ".weight") || absl::EndsWith(v.name, ".bias"));
}

bool IsStateConstant(const TraceValue& v) {
  return v.kind == Kind::kConstant &&
         (IsParameter(v) || absl::EndsWith(v.name, ".grad") ||
          absl::EndsWith(v.name, ".running_mean") ||
          absl::EndsWith(v.name, ".running_var"));
}

// The value whose storage `v` shares through versions.
const TraceValue& VersionRoot(const Trace& trace, const TraceValue& v) {
  const TraceValue* r = &v;
  while (r->kind == Kind::kVersion) r = &trace.values[r->base];
  return *r;
}

int64_t ParameterBytes(const Trace& trace) {
  int64_t sum = 0;
  for (const TraceValue& v : trace.values) {
    if (IsParameter(v)) sum += v.bytes;
  }
  return sum;
}

struct Peak {
  int64_t all = 0;          // constants included
  int64_t activations = 0;  // what the iteration creates, with workspace
  int64_t live_at_end = 0;  // activations still held after the last op
};

// Walks the trace counting each storage once while any name refers to it.
Peak WalkLiveMemory(const Trace& trace) {
  const size_t n = trace.values.size();
  std::vector<size_t> root(n);
  for (size_t v = 0; v < n; ++v) {
    size_t r = v;
    while (trace.values[r].kind == Kind::kAlias ||
           trace.values[r].kind == Kind::kVersion) {
      r = trace.values[r].base;
    }
    root[v] = r;
  }
  std::vector<int> names(n, 0);
  int64_t all = 0;
  int64_t act = 0;
  Peak peak;
  auto hold = [&](size_t v) {
    const TraceValue& r = trace.values[root[v]];
    if (names[root[v]]++ > 0) return;
    all += r.bytes;
    if (r.kind != Kind::kConstant) act += r.bytes;
  };
  auto drop = [&](size_t v) {
    const TraceValue& r = trace.values[root[v]];
    if (--names[root[v]] > 0) return;
    all -= r.bytes;
    if (r.kind != Kind::kConstant) act -= r.bytes;
  };
  for (size_t v = 0; v < n; ++v) {
    if (trace.values[v].kind == Kind::kConstant) hold(v);
  }
  for (int32_t v : trace.initial_releases) drop(v);
  for (const TraceOp& op : trace.ops) {
    for (int32_t v : op.outputs) {
      if (trace.values[v].kind == Kind::kVersion) drop(trace.values[v].base);
      hold(v);
    }
    peak.all = std::max(peak.all, all + op.workspace_bytes);
    peak.activations = std::max(peak.activations, act + op.workspace_bytes);
    for (int32_t v : op.releases) drop(v);
  }
  peak.live_at_end = act;
  return peak;
}

// Layers whose backward is an op named "<forward>_backward"; residual adds
// and the head merge pass their gradient on without a kernel.
bool HasBackwardOp(const TraceOp& op) {
  return op.name != "add" && op.name != "contiguous";
}

struct LayerPair {
  const TraceOp* forward;
  const TraceOp* backward;
};

// Pairs each forward layer with its backward op: backward replays the
// forward layers in reverse.
std::vector<LayerPair> PairLayers(const Trace& trace) {
  std::vector<const TraceOp*> forward;
  std::vector<const TraceOp*> backward;
  for (const TraceOp& op : trace.ops) {
    if (op.phase == Phase::kForward && HasBackwardOp(op)) {
      forward.push_back(&op);
    } else if (op.phase == Phase::kBackward &&
               absl::EndsWith(op.name, "_backward")) {
      backward.push_back(&op);
    }
  }
  EXPECT_EQ(forward.size(), backward.size()) << trace.name;
  std::vector<LayerPair> pairs;
  for (size_t i = 0; i < std::min(forward.size(), backward.size()); ++i) {
    const TraceOp* f = forward[forward.size() - 1 - i];
    EXPECT_EQ(backward[i]->name, f->name + "_backward")
        << trace.name << " backward op " << i;
    pairs.push_back({f, backward[i]});
  }
  return pairs;
}

bool IsDense(const std::string& op) {
  return op == "conv2d" || op == "conv_transpose2d" || op == "linear" ||
         op == "matmul";
}

std::string DTypeName(DType d) { return d == DType::kFp32 ? "fp32" : "fp16"; }

TEST(ModelTraces, ModelNamesAreTheSevenNetworks) {
  EXPECT_THAT(ModelNames(), ElementsAre("resnet50", "resnet101", "resnet152",
                                        "densenet121", "vgg16", "unet", "gpt"));
}

TEST(ModelTraces, EveryModelValidatesInBothDtypesAtBatchesOneAndSeven) {
  for (const std::string& model : ModelNames()) {
    for (DType dtype : {DType::kFp32, DType::kFp16}) {
      for (int batch : {1, 7}) {
        SCOPED_TRACE(absl::StrCat(model, " ", DTypeName(dtype), " b", batch));
        const Trace trace = Build(model, batch, dtype);
        EXPECT_TRUE(trace.Validate().ok()) << trace.Validate();
        EXPECT_EQ(trace.name,
                  absl::StrCat(model, "-b", batch, "-", DTypeName(dtype)));
        ASSERT_FALSE(trace.ops.empty());
        // All of forward, then all of backward, then the optimizer step.
        size_t first_backward = trace.ops.size();
        for (size_t i = 0; i < trace.ops.size(); ++i) {
          if (trace.ops[i].phase == Phase::kBackward) {
            first_backward = std::min(first_backward, i);
          } else {
            EXPECT_LT(i, first_backward) << "forward op after backward";
          }
        }
        EXPECT_GT(first_backward, 0u);
        EXPECT_LT(first_backward, trace.ops.size());
        EXPECT_EQ(trace.ops.back().name, "optimizer_step");
      }
    }
  }
}

TEST(ModelTraces, ResNet50ActivationsMatchTheLayerShapes) {
  const Trace t = Build("resnet50", 8);
  EXPECT_EQ(BytesOf(t, "input"), 8 * 3 * 224 * 224 * 4);
  EXPECT_EQ(BytesOf(t, "labels"), 8 * 8);
  EXPECT_EQ(BytesOf(t, "conv1"), 8 * 64 * 112 * 112 * 4);
  EXPECT_EQ(BytesOf(t, "maxpool"), 8 * 64 * 56 * 56 * 4);
  EXPECT_EQ(BytesOf(t, "maxpool.indices"), 8 * 64 * 56 * 56 * 8);
  EXPECT_EQ(BytesOf(t, "layer1.0.conv3"), 8 * 256 * 56 * 56 * 4);
  // The stride sits on the 3x3 convolution (torchvision v1.5).
  EXPECT_EQ(BytesOf(t, "layer2.0.conv1"), 8 * 128 * 56 * 56 * 4);
  EXPECT_EQ(BytesOf(t, "layer2.0.conv2"), 8 * 128 * 28 * 28 * 4);
  EXPECT_EQ(BytesOf(t, "layer2.0.downsample.0"), 8 * 512 * 28 * 28 * 4);
  EXPECT_EQ(BytesOf(t, "layer4.2.conv3"), 8 * 2048 * 7 * 7 * 4);
  EXPECT_EQ(BytesOf(t, "avgpool"), 8 * 2048 * 4);
  EXPECT_EQ(BytesOf(t, "fc"), 8 * 1000 * 4);
  EXPECT_EQ(BytesOf(t, "layer3.5.bn3.stats"), 2 * 1024 * 4);
}

TEST(ModelTraces, DeeperResNetsRepeatTheThirdStage) {
  const Trace r101 = Build("resnet101", 2);
  const Trace r152 = Build("resnet152", 2);
  EXPECT_NE(Find(r101, "layer3.22.conv3"), nullptr);
  EXPECT_EQ(Find(r101, "layer3.23.conv3"), nullptr);
  EXPECT_NE(Find(r152, "layer2.7.conv3"), nullptr);
  EXPECT_NE(Find(r152, "layer3.35.conv3"), nullptr);
  EXPECT_EQ(Find(r152, "layer3.36.conv3"), nullptr);
  EXPECT_EQ(BytesOf(r152, "layer3.35.conv3"), 2 * 1024 * 14 * 14 * 4);
}

TEST(ModelTraces, Vgg16ActivationsMatchTheLayerShapes) {
  const Trace t = Build("vgg16", 4);
  EXPECT_EQ(BytesOf(t, "conv1_1"), 4 * 64 * 224 * 224 * 4);
  EXPECT_EQ(BytesOf(t, "pool1"), 4 * 64 * 112 * 112 * 4);
  EXPECT_EQ(BytesOf(t, "conv3_3"), 4 * 256 * 56 * 56 * 4);
  EXPECT_EQ(BytesOf(t, "pool5"), 4 * 512 * 7 * 7 * 4);
  EXPECT_EQ(BytesOf(t, "avgpool"), 4 * 512 * 7 * 7 * 4);
  EXPECT_EQ(BytesOf(t, "fc6"), 4 * 4096 * 4);
  EXPECT_EQ(BytesOf(t, "dropout6.mask"), 4 * 4096);
  EXPECT_EQ(BytesOf(t, "fc8"), 4 * 1000 * 4);
  int convs = 0;
  int linears = 0;
  for (const TraceOp& op : t.ops) {
    convs += op.name == "conv2d";
    linears += op.name == "linear";
  }
  EXPECT_EQ(convs, 13);
  EXPECT_EQ(linears, 3);
}

TEST(ModelTraces, DenseNet121ConcatenatesEveryEarlierFeatureIntoANewTensor) {
  const int64_t b = 3;
  const Trace t = Build("densenet121", b);
  for (int i = 1; i <= 6; ++i) {
    const std::string name = absl::StrCat("denseblock1.denselayer", i, ".cat");
    SCOPED_TRACE(name);
    EXPECT_EQ(BytesOf(t, name), b * (64 + 32 * (i - 1)) * 56 * 56 * 4);
    const TraceValue* v = Find(t, name);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(v->kind, Kind::kOutput);
    EXPECT_EQ(t.ops[v->op].name, "cat");
    EXPECT_EQ(t.ops[v->op].inputs.size(), static_cast<size_t>(i));
  }
  EXPECT_EQ(BytesOf(t, "denseblock1.cat"), b * 256 * 56 * 56 * 4);
  EXPECT_EQ(BytesOf(t, "transition1.pool"), b * 128 * 28 * 28 * 4);
  EXPECT_EQ(BytesOf(t, "denseblock2.cat"), b * 512 * 28 * 28 * 4);
  EXPECT_EQ(BytesOf(t, "denseblock3.cat"), b * 1024 * 14 * 14 * 4);
  EXPECT_EQ(BytesOf(t, "denseblock4.denselayer16.cat"),
            b * (512 + 15 * 32) * 7 * 7 * 4);
  EXPECT_EQ(BytesOf(t, "denseblock4.cat"), b * 1024 * 7 * 7 * 4);
  EXPECT_EQ(BytesOf(t, "denseblock4.denselayer3.conv1"), b * 128 * 7 * 7 * 4);
}

TEST(ModelTraces, GptAttentionScoresAreBatchByHeadsBySeqBySeq) {
  ModelOptions o;
  o.batch = 2;
  o.dtype = DType::kFp16;
  o.gpt_layers = 2;
  o.gpt_hidden = 64;
  o.gpt_heads = 4;
  o.gpt_seq = 128;
  o.gpt_vocab = 1000;
  const Trace t = Build("gpt", o);
  const int64_t bsh2 = 2 * 128 * 64 * 2;
  EXPECT_EQ(BytesOf(t, "h.1.attn.scores"), 2 * 4 * 128 * 128 * 2);
  EXPECT_EQ(BytesOf(t, "h.1.attn.softmax"), 2 * 4 * 128 * 128 * 2);
  EXPECT_EQ(BytesOf(t, "h.1.attn.attn_dropout.mask"), 2 * 4 * 128 * 128);
  EXPECT_EQ(BytesOf(t, "h.0.attn.c_attn"), 3 * bsh2);
  EXPECT_EQ(BytesOf(t, "h.0.attn.context"), bsh2);
  EXPECT_EQ(BytesOf(t, "h.0.mlp.c_fc"), 4 * bsh2);
  EXPECT_EQ(BytesOf(t, "h.0.mlp.gelu"), 4 * bsh2);
  EXPECT_EQ(BytesOf(t, "h.0.ln_1.stats"), 2 * (2 * 128) * 4);
  EXPECT_EQ(BytesOf(t, "wpe"), 128 * 64 * 2);
  EXPECT_EQ(BytesOf(t, "lm_head"), 2 * 128 * 1000 * 2);
  EXPECT_EQ(BytesOf(t, "tokens"), 2 * 128 * 8);
  // q, k and v are views: they keep the fused projection's storage.
  for (const char* part : {"q", "k", "v"}) {
    const TraceValue* v = Find(t, absl::StrCat("h.0.attn.", part));
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(v->kind, Kind::kAlias);
    EXPECT_EQ(t.values[v->base].name, "h.0.attn.c_attn");
  }
}

TEST(ModelTraces, UNetHalvesFourTimesAndDoublesBack) {
  ModelOptions o;
  o.batch = 3;
  o.height = 160;
  o.width = 96;
  const Trace t = Build("unet", o);
  EXPECT_EQ(BytesOf(t, "inc.conv2"), 3 * 64 * 160 * 96 * 4);
  EXPECT_EQ(BytesOf(t, "down1.pool"), 3 * 64 * 80 * 48 * 4);
  EXPECT_EQ(BytesOf(t, "down4.conv2"), 3 * 1024 * 10 * 6 * 4);  // bottleneck
  EXPECT_EQ(BytesOf(t, "up1.up"), 3 * 512 * 20 * 12 * 4);
  EXPECT_EQ(BytesOf(t, "up1.cat"), 3 * 1024 * 20 * 12 * 4);
  EXPECT_EQ(BytesOf(t, "up4.cat"), 3 * 128 * 160 * 96 * 4);
  EXPECT_EQ(BytesOf(t, "outc"), 3 * 2 * 160 * 96 * 4);
  EXPECT_EQ(BytesOf(t, "labels"), 3 * 160 * 96 * 8);
}

TEST(ModelTraces, ActivationSizesScaleLinearlyWithBatch) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace one = Build(model, 1);
    const Trace three = Build(model, 3);
    ASSERT_EQ(one.values.size(), three.values.size());
    ASSERT_EQ(one.ops.size(), three.ops.size());
    for (size_t i = 0; i < one.values.size(); ++i) {
      const TraceValue& v1 = one.values[i];
      const TraceValue& v3 = three.values[i];
      ASSERT_EQ(v1.name, v3.name);
      if (IsStateConstant(VersionRoot(one, v1)) || v1.name == "positions") {
        EXPECT_EQ(v3.bytes, v1.bytes) << v1.name;
        continue;
      }
      // The loss is a scalar, batch norm statistics are per channel and
      // position embeddings are shared by the batch.
      const bool per_batch = v1.name == "loss" ||
                             absl::StartsWith(v1.name, "wpe") ||
                             (absl::EndsWith(v1.name, ".stats") && v1.op >= 0 &&
                              one.ops[v1.op].name == "batch_norm");
      EXPECT_EQ(v3.bytes, per_batch ? v1.bytes : 3 * v1.bytes) << v1.name;
    }
  }
}

TEST(ModelTraces, HalfPrecisionHalvesFloatTensors) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace fp32 = Build(model, 2, DType::kFp32);
    const Trace fp16 = Build(model, 2, DType::kFp16);
    ASSERT_EQ(fp32.values.size(), fp16.values.size());
    int64_t float_bytes = 0;
    for (size_t i = 0; i < fp32.values.size(); ++i) {
      const TraceValue& v32 = fp32.values[i];
      const TraceValue& v16 = fp16.values[i];
      ASSERT_EQ(v32.name, v16.name);
      // Indices, masks, statistics and integer data keep their types.
      const bool typed = absl::EndsWith(v32.name, ".indices") ||
                         absl::EndsWith(v32.name, ".mask") ||
                         absl::EndsWith(v32.name, ".stats") ||
                         v32.name == "labels" || v32.name == "tokens" ||
                         v32.name == "positions";
      if (typed) {
        EXPECT_EQ(v16.bytes, v32.bytes) << v32.name;
      } else {
        EXPECT_EQ(2 * v16.bytes, v32.bytes) << v32.name;
        float_bytes += v32.bytes;
      }
    }
    EXPECT_GT(float_bytes, 0);
    EXPECT_LT(WalkLiveMemory(fp16).activations,
              WalkLiveMemory(fp32).activations);
  }
}

TEST(ModelTraces, ParameterCountsMatchTheReferenceImplementations) {
  // Ronneberger U-Net with padded, biased 3x3 convolutions, 2x2
  // up-convolutions and a 1x1 head to 2 classes.
  auto double_conv = [](int64_t in, int64_t out) {
    return 9 * in * out + out + 9 * out * out + out;
  };
  auto up = [](int64_t in, int64_t out) { return 4 * in * out + out; };
  const int64_t unet =
      double_conv(3, 64) + double_conv(64, 128) + double_conv(128, 256) +
      double_conv(256, 512) + double_conv(512, 1024) + up(1024, 512) +
      double_conv(1024, 512) + up(512, 256) + double_conv(512, 256) +
      up(256, 128) + double_conv(256, 128) + up(128, 64) +
      double_conv(128, 64) + 64 * 2 + 2;
  EXPECT_EQ(unet, 31'031'810);
  // torchvision's counts; GPT-2 small (124M) with the LM head tied to the
  // token embedding and 1024 learned positions.
  const std::map<std::string, int64_t> expected = {
      {"resnet50", 25'557'032},  {"resnet101", 44'549'160},
      {"resnet152", 60'192'808}, {"densenet121", 7'978'856},
      {"vgg16", 138'357'544},    {"unet", unet},
      {"gpt", 124'439'808}};
  for (const auto& [model, params] : expected) {
    SCOPED_TRACE(model);
    EXPECT_EQ(ParameterBytes(Build(model, 1, DType::kFp32)), params * 4);
    EXPECT_EQ(ParameterBytes(Build(model, 1, DType::kFp16)), params * 2);
  }
}

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

TEST(ModelTraces, WeightsAndGradientsAreUpdatedInPlace) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 2);
    const int32_t last = static_cast<int32_t>(t.ops.size()) - 1;
    std::map<int32_t, int> weight_versions;
    std::map<int32_t, int> grad_versions;
    for (const TraceValue& v : t.values) {
      if (v.kind != Kind::kVersion) continue;
      int32_t root = v.base;
      while (t.values[root].kind == Kind::kVersion) root = t.values[root].base;
      const TraceValue& r = t.values[root];
      if (IsParameter(r)) {
        ++weight_versions[root];
        EXPECT_EQ(v.op, last) << r.name << " updated before the step";
      } else if (r.kind == Kind::kConstant && absl::EndsWith(r.name, ".grad")) {
        ++grad_versions[root];
        EXPECT_EQ(t.ops[v.op].phase, Phase::kBackward) << r.name;
        EXPECT_NE(v.op, last) << r.name;
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
    const TraceOp& step = t.ops.back();
    ASSERT_EQ(step.name, "optimizer_step");
    std::set<int32_t> inputs(step.inputs.begin(), step.inputs.end());
    int64_t weights = 0;
    int states = 0;
    for (int32_t v = 0; v < static_cast<int32_t>(t.values.size()); ++v) {
      const TraceValue& value = t.values[v];
      if (IsParameter(value)) weights += value.bytes;
      if (value.kind != Kind::kConstant) continue;
      for (const std::string& suffix : c.suffixes) {
        if (!absl::EndsWith(value.name, suffix)) continue;
        ++states;
        const std::string weight =
            value.name.substr(0, value.name.size() - suffix.size());
        EXPECT_EQ(value.bytes, BytesOf(t, weight)) << value.name;
        EXPECT_TRUE(inputs.count(v)) << value.name << " not read by the step";
      }
    }
    int params = 0;
    for (const TraceValue& v : t.values) params += IsParameter(v) ? 1 : 0;
    EXPECT_EQ(states, params * static_cast<int>(c.suffixes.size()));
    // Traffic: the gradient, and the weight and each state both ways.
    const double bytes = (3.0 + 2.0 * c.suffixes.size()) * weights;
    EXPECT_NEAR(step.time_ns, bytes / A100().memory_bytes_per_s * 1e9,
                step.time_ns * 0.01 + 1000);
    // Adam's multi-tensor step makes the square roots of exp_avg_sq anew.
    EXPECT_EQ(step.workspace_bytes,
              c.optimizer == Optimizer::kAdam ? weights : 0);
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

TEST(ModelTraces, PeakLiveMemoryGrowsWithBatch) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Peak one = WalkLiveMemory(Build(model, 1));
    const Peak two = WalkLiveMemory(Build(model, 2));
    const Peak four = WalkLiveMemory(Build(model, 4));
    EXPECT_LT(one.all, two.all);
    EXPECT_LT(two.all, four.all);
    EXPECT_GT(one.all, one.activations);  // the weights are there too
    // Activations are per sample, bar a few per-channel statistics.
    EXPECT_GT(four.activations, 3 * one.activations);
    EXPECT_LE(four.activations, 4 * one.activations);
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

TEST(ModelTraces, DenseBackwardTakesTwiceTheForwardTime) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 2);
    int dense = 0;
    for (const auto& [f, b] : PairLayers(t)) {
      if (!IsDense(f->name)) continue;
      ++dense;
      EXPECT_EQ(b->time_ns, 2 * f->time_ns) << f->name;
      EXPECT_EQ(b->workspace_bytes, f->workspace_bytes) << f->name;
    }
    EXPECT_GT(dense, 0);
  }
}

TEST(ModelTraces, EveryOpTakesTimeAndHalfPrecisionIsFaster) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace fp32 = Build(model, 4, DType::kFp32);
    int64_t forward = 0;
    int64_t backward = 0;
    for (const TraceOp& op : fp32.ops) {
      EXPECT_GT(op.time_ns, 0) << op.name;
      (op.phase == Phase::kForward ? forward : backward) += op.time_ns;
    }
    EXPECT_EQ(fp32.ComputeNs(), forward + backward);
    EXPECT_GT(backward, forward);
    EXPECT_LT(Build(model, 4, DType::kFp16).ComputeNs(), fp32.ComputeNs());
  }
}

TEST(ModelTraces, TimesFollowTheDeviceRates) {
  const DeviceProfile a100 = A100();
  const Trace t = Build("resnet50", 8);
  const TraceValue* conv1 = Find(t, "conv1");
  ASSERT_NE(conv1, nullptr);
  const double macs = 8.0 * 64 * 112 * 112 * 3 * 7 * 7;
  EXPECT_EQ(
      t.ops[conv1->op].time_ns,
      static_cast<int64_t>(std::ceil(2 * macs / a100.fp32_flops_per_s * 1e9)));
  // The stem's ReLU reads and writes the batch norm output once.
  const TraceOp* relu = nullptr;
  for (const TraceOp& op : t.ops) {
    if (op.name == "relu") {
      relu = &op;
      break;
    }
  }
  ASSERT_NE(relu, nullptr);
  EXPECT_EQ(relu->time_ns,
            static_cast<int64_t>(
                std::ceil(2.0 * conv1->bytes / a100.memory_bytes_per_s * 1e9)));
  // A faster device runs the same trace in less time.
  absl::StatusOr<DeviceProfile> titan = FindDeviceProfile("titan-v");
  ASSERT_TRUE(titan.ok());
  ModelOptions o;
  o.batch = 8;
  EXPECT_GT(Build("resnet50", o, *titan).ComputeNs(), t.ComputeNs());
}

TEST(ModelTraces, ConvolutionsHaveABoundedWorkspace) {
  const Trace t = Build("vgg16", 32);
  int convs = 0;
  bool capped = false;
  for (const TraceOp& op : t.ops) {
    if (op.name != "conv2d") {
      if (op.phase == Phase::kForward) {
        EXPECT_EQ(op.workspace_bytes, 0) << op.name;
      }
      continue;
    }
    ++convs;
    const int64_t out = t.values[op.outputs[0]].bytes;
    EXPECT_EQ(op.workspace_bytes, std::min(out, 64 * kMiB));
    capped = capped || out > 64 * kMiB;
  }
  EXPECT_EQ(convs, 13);
  EXPECT_TRUE(capped);
}

TEST(ModelTraces, TracesSurviveTheTextFormat) {
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Trace t = Build(model, 2);
    absl::StatusOr<Trace> parsed = ParseTrace(FormatTrace(t));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ASSERT_EQ(parsed->ops.size(), t.ops.size());
    EXPECT_EQ(parsed->ComputeNs(), t.ComputeNs());
    EXPECT_EQ(WalkLiveMemory(*parsed).all, WalkLiveMemory(t).all);
  }
}

struct BadOptionsCase {
  std::string model;
  ModelOptions options;
  std::vector<std::string> message;
};

TEST(ModelTraces, RejectsBadOptionsSayingWhatIsWrong) {
  auto with = [](auto edit) {
    ModelOptions o;
    edit(o);
    return o;
  };
  const std::vector<BadOptionsCase> cases = {
      {"alexnet", {}, {"unknown model 'alexnet'", "resnet50", "unet", "gpt"}},
      {"resnet50",
       with([](ModelOptions& o) { o.batch = 0; }),
       {"batch must be positive", "0"}},
      {"gpt",
       with([](ModelOptions& o) { o.batch = -3; }),
       {"batch must be positive", "-3"}},
      {"resnet50",
       with([](ModelOptions& o) { o.height = -1; }),
       {"height and width must be positive"}},
      {"vgg16",
       with([](ModelOptions& o) { o.height = o.width = 16; }),
       {"vgg16", "16x16", "too small", "pool5"}},
      {"densenet121",
       with([](ModelOptions& o) { o.height = o.width = 8; }),
       {"densenet121", "too small", "transition2.pool"}},
      {"unet",
       with([](ModelOptions& o) { o.height = 100; }),
       {"divisible by 16", "100x224"}},
      {"gpt",
       with([](ModelOptions& o) { o.gpt_heads = 5; }),
       {"gpt_heads (5) must divide gpt_hidden (768)"}},
      {"gpt",
       with([](ModelOptions& o) { o.gpt_seq = 0; }),
       {"gpt_seq must be positive"}},
      {"gpt",
       with([](ModelOptions& o) { o.gpt_layers = 100000; }),
       {"gpt_layers must be at most"}},
      {"gpt",
       with([](ModelOptions& o) {
         o.batch = 1 << 30;
         o.gpt_seq = 1 << 30;
       }),
       {"overflows 64 bits"}},
  };
  for (const BadOptionsCase& c : cases) {
    SCOPED_TRACE(c.model);
    const absl::StatusOr<Trace> t = BuildModelTrace(c.model, c.options, A100());
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& part : c.message) {
      EXPECT_THAT(t.status().message(), HasSubstr(part));
    }
  }
}

TEST(ModelTraces, SmallestInputsEachNetworkAccepts) {
  ModelOptions o;
  o.batch = 1;
  o.height = o.width = 32;  // VGG's five pools need 32
  EXPECT_TRUE(BuildModelTrace("vgg16", o, A100()).ok());
  o.height = o.width = 31;
  EXPECT_FALSE(BuildModelTrace("vgg16", o, A100()).ok());
  o.height = o.width = 16;
  EXPECT_TRUE(BuildModelTrace("unet", o, A100()).ok());
  o.height = o.width = 1;  // strided convolutions with padding never vanish
  EXPECT_TRUE(BuildModelTrace("resnet50", o, A100()).ok());
  o.gpt_layers = o.gpt_hidden = o.gpt_heads = o.gpt_seq = o.gpt_vocab = 1;
  EXPECT_TRUE(BuildModelTrace("gpt", o, A100()).ok());
}

TEST(ModelTraces, RejectsADeviceWithoutRates) {
  DeviceProfile device = A100();
  device.fp16_flops_per_s = 0;
  ModelOptions o;
  o.dtype = DType::kFp16;
  const absl::StatusOr<Trace> t = BuildModelTrace("resnet50", o, device);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("fp16"));
  o.dtype = DType::kFp32;
  EXPECT_TRUE(BuildModelTrace("resnet50", o, device).ok());
}

}  // namespace
}  // namespace deltad::sim
