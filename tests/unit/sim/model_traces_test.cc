// The tensors of each network's trace: the layer shapes, the parameter
// counts, and how the sizes follow the batch and the precision.

#include "policies/sim/model_traces.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/trace.h"
#include "tests/unit/sim/model_traces_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAre;
using Kind = TraceValue::Kind;

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
      // Gradients of parameters, made in backward, are the parameters' size.
      const bool parameter_grad = absl::EndsWith(v1.name, ".grad") &&
                                  (absl::EndsWith(v1.name, ".weight.grad") ||
                                   absl::EndsWith(v1.name, ".bias.grad"));
      if (IsStateConstant(VersionRoot(one, v1)) || parameter_grad ||
          v1.name == "positions") {
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

// With the gradient buffers kept (constants), what the iteration makes is
// per sample; set to None they would add the weights' size at every batch.
TEST(ModelTraces, PeakLiveMemoryGrowsWithBatch) {
  const auto build = [](const std::string& model, int batch) {
    ModelOptions o;
    o.batch = batch;
    o.grads_set_to_none = false;
    return Build(model, o);
  };
  for (const std::string& model : ModelNames()) {
    SCOPED_TRACE(model);
    const Peak one = WalkLiveMemory(build(model, 1));
    const Peak two = WalkLiveMemory(build(model, 2));
    const Peak four = WalkLiveMemory(build(model, 4));
    EXPECT_LT(one.all, two.all);
    EXPECT_LT(two.all, four.all);
    EXPECT_GT(one.all, one.activations);  // the weights are there too
    // Activations are per sample, bar a few per-channel statistics.
    EXPECT_GT(four.activations, 3 * one.activations);
    EXPECT_LE(four.activations, 4 * one.activations);
  }
}

}  // namespace
}  // namespace deltad::sim
