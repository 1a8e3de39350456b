#include "policies/sim/model_traces.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/sim/layer_net.h"

namespace deltad::sim {
namespace {

constexpr int64_t kImageNetClasses = 1000;
constexpr int64_t kUNetClasses = 2;  // Ronneberger et al.: cell / border
// Guards the op count against absurd requests; GPT-3 has 96 layers.
constexpr int kMaxGptLayers = 1000;

// --- Networks.

// Image classifiers end in log-softmax and NLL over ImageNet's classes, as
// F.cross_entropy does.
void ClassificationLoss(LayerNet& net, int32_t logits, int32_t labels) {
  net.NllLoss(net.LogSoftmax("log_softmax", logits), labels);
}

int32_t ConvBnRelu(LayerNet& net, const std::string& prefix,
                   const std::string& n, int32_t x, int64_t out_c, int64_t k,
                   int64_t stride, int64_t pad) {
  int32_t y = net.Conv2d(prefix + "conv" + n, x, out_c, k, stride, pad, false);
  y = net.BatchNorm2d(prefix + "bn" + n, y);
  return net.Relu(prefix + "relu" + n, y);
}

// torchvision ResNet with Bottleneck blocks (v1.5: stride on the 3x3).
void BuildResNet(LayerNet& net, const std::array<int, 4>& blocks, int64_t batch,
                 int64_t height, int64_t width) {
  const int32_t input =
      net.Data("input", {batch, 3, height, width}, net.elem());
  const int32_t labels = net.Data("labels", {batch}, kIndexBytes);
  int32_t x = net.Conv2d("conv1", input, 64, 7, 2, 3, false);
  x = net.BatchNorm2d("bn1", x);
  x = net.Relu("relu", x);
  x = net.MaxPool2d("maxpool", x, 3, 2, 1);
  int64_t in_c = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t planes = int64_t{64} << stage;
    for (int i = 0; i < blocks[stage]; ++i) {
      const std::string p = absl::StrCat("layer", stage + 1, ".", i, ".");
      const int64_t stride = (stage > 0 && i == 0) ? 2 : 1;
      int32_t y = ConvBnRelu(net, p, "1", x, planes, 1, 1, 0);
      y = ConvBnRelu(net, p, "2", y, planes, 3, stride, 1);
      y = net.Conv2d(p + "conv3", y, planes * 4, 1, 1, 0, false);
      y = net.BatchNorm2d(p + "bn3", y);
      int32_t identity = x;
      if (stride != 1 || in_c != planes * 4) {
        identity =
            net.Conv2d(p + "downsample.0", x, planes * 4, 1, stride, 0, false);
        identity = net.BatchNorm2d(p + "downsample.1", identity);
      }
      y = net.Add(p + "add", y, identity, /*in_place=*/true);
      x = net.Relu(p + "relu3", y);
      in_c = planes * 4;
    }
  }
  x = net.AdaptiveAvgPool2d("avgpool", x, 1, 1);
  ClassificationLoss(net, net.Linear("fc", x, kImageNetClasses, true), labels);
}

// torchvision DenseNet-121 without memory-efficient checkpointing: every
// dense layer concatenates all earlier features into a new tensor.
void BuildDenseNet121(LayerNet& net, int64_t batch, int64_t height,
                      int64_t width) {
  constexpr int64_t kGrowth = 32;
  constexpr int64_t kBottleneck = 4 * kGrowth;  // bn_size 4
  constexpr std::array<int, 4> kLayers = {6, 12, 24, 16};
  const int32_t input =
      net.Data("input", {batch, 3, height, width}, net.elem());
  const int32_t labels = net.Data("labels", {batch}, kIndexBytes);
  int32_t x = net.Conv2d("conv0", input, 64, 7, 2, 3, false);
  x = net.BatchNorm2d("norm0", x);
  x = net.Relu("relu0", x);
  x = net.MaxPool2d("pool0", x, 3, 2, 1);
  int64_t channels = 64;
  for (int block = 0; block < 4; ++block) {
    const std::string bp = absl::StrCat("denseblock", block + 1);
    std::vector<int32_t> features = {x};
    for (int i = 0; i < kLayers[block]; ++i) {
      const std::string p = absl::StrCat(bp, ".denselayer", i + 1, ".");
      int32_t y = net.Cat(p + "cat", features);
      y = net.BatchNorm2d(p + "norm1", y);
      y = net.Relu(p + "relu1", y);
      y = net.Conv2d(p + "conv1", y, kBottleneck, 1, 1, 0, false);
      y = net.BatchNorm2d(p + "norm2", y);
      y = net.Relu(p + "relu2", y);
      features.push_back(net.Conv2d(p + "conv2", y, kGrowth, 3, 1, 1, false));
    }
    x = net.Cat(bp + ".cat", features);
    channels += kLayers[block] * kGrowth;
    if (block < 3) {
      const std::string p = absl::StrCat("transition", block + 1, ".");
      x = net.BatchNorm2d(p + "norm", x);
      x = net.Relu(p + "relu", x);
      channels /= 2;
      x = net.Conv2d(p + "conv", x, channels, 1, 1, 0, false);
      x = net.AvgPool2d(p + "pool", x, 2);
    }
  }
  x = net.BatchNorm2d("norm5", x);
  x = net.Relu("relu5", x);
  x = net.AdaptiveAvgPool2d("avgpool", x, 1, 1);
  ClassificationLoss(net, net.Linear("classifier", x, kImageNetClasses, true),
                     labels);
}

// torchvision VGG-16 (configuration D, no batch norm).
void BuildVgg16(LayerNet& net, int64_t batch, int64_t height, int64_t width) {
  constexpr std::array<std::array<int64_t, 2>, 5> kBlocks = {
      {{2, 64}, {2, 128}, {3, 256}, {3, 512}, {3, 512}}};
  const int32_t input =
      net.Data("input", {batch, 3, height, width}, net.elem());
  const int32_t labels = net.Data("labels", {batch}, kIndexBytes);
  int32_t x = input;
  for (size_t block = 0; block < kBlocks.size(); ++block) {
    const auto [convs, channels] = kBlocks[block];
    for (int64_t i = 1; i <= convs; ++i) {
      const std::string n = absl::StrCat(block + 1, "_", i);
      x = net.Conv2d("conv" + n, x, channels, 3, 1, 1, true);
      x = net.Relu("relu" + n, x);
    }
    x = net.MaxPool2d(absl::StrCat("pool", block + 1), x, 2, 2, 0);
  }
  x = net.AdaptiveAvgPool2d("avgpool", x, 7, 7);
  x = net.Relu("relu6", net.Linear("fc6", x, 4096, true));
  x = net.Dropout("dropout6", x);
  x = net.Relu("relu7", net.Linear("fc7", x, 4096, true));
  x = net.Dropout("dropout7", x);
  ClassificationLoss(net, net.Linear("fc8", x, kImageNetClasses, true), labels);
}

int32_t DoubleConv(LayerNet& net, const std::string& p, int32_t x,
                   int64_t out_c) {
  x = net.Relu(p + ".relu1", net.Conv2d(p + ".conv1", x, out_c, 3, 1, 1, true));
  return net.Relu(p + ".relu2",
                  net.Conv2d(p + ".conv2", x, out_c, 3, 1, 1, true));
}

// U-LayerNet after Ronneberger et al. (2015) with padded convolutions: no batch
// norm, biased 3x3 convolutions, 2x2 up-convolutions, skip features first
// in each concatenation, a 1x1 head to two classes and a per-pixel loss.
void BuildUNet(LayerNet& net, int64_t batch, int64_t height, int64_t width) {
  const int32_t input =
      net.Data("input", {batch, 3, height, width}, net.elem());
  const int32_t labels =
      net.Data("labels", {batch, height, width}, kIndexBytes);
  std::vector<int32_t> skips;
  int32_t x = DoubleConv(net, "inc", input, 64);
  for (int i = 1; i <= 4; ++i) {
    skips.push_back(x);
    const std::string p = absl::StrCat("down", i);
    x = net.MaxPool2d(p + ".pool", x, 2, 2, 0);
    x = DoubleConv(net, p, x, int64_t{64} << i);
  }
  for (int i = 1; i <= 4; ++i) {
    const std::string p = absl::StrCat("up", i);
    const int64_t out_c = int64_t{1024} >> i;
    x = net.ConvTranspose2d(p + ".up", x, out_c);
    x = net.Cat(p + ".cat", {skips[4 - i], x});
    x = DoubleConv(net, p, x, out_c);
  }
  x = net.Conv2d("outc", x, kUNetClasses, 1, 1, 0, true);
  net.NllLoss(net.LogSoftmax("log_softmax", x), labels);
}

// A GPT-2 style decoder (nanoGPT layout): learned positions, pre-norm
// blocks, fused qkv projection, GELU MLP, LM head tied to the
// token embedding.
void BuildGpt(LayerNet& net, const ModelOptions& o) {
  const int64_t b = o.batch;
  const int64_t s = o.gpt_seq;
  const int64_t h = o.gpt_hidden;
  const int64_t heads = o.gpt_heads;
  const int64_t d = h / heads;
  const int32_t tokens = net.Data("tokens", {b, s}, kIndexBytes);
  const int32_t labels = net.Data("labels", {b, s}, kIndexBytes);
  const int32_t positions = net.Data("positions", {s}, kIndexBytes);
  const int wte = net.Param("wte.weight", int64_t{o.gpt_vocab} * h);
  const int wpe = net.Param("wpe.weight", s * h);
  const int32_t tok = net.Embedding("wte", tokens, wte, {b, s, h});
  const int32_t pos = net.Embedding("wpe", positions, wpe, {1, s, h});
  int32_t x = net.Dropout("drop", net.AddBroadcast("embed", tok, pos));
  for (int layer = 0; layer < o.gpt_layers; ++layer) {
    const std::string p = absl::StrCat("h.", layer, ".");
    int32_t a = net.LayerNorm(p + "ln_1", x);
    a = net.Linear(p + "attn.c_attn", a, 3 * h, true);
    const std::vector<int32_t> qkv =
        net.Split(p + "attn", a, {"q", "k", "v"}, {b, heads, s, d});
    // The 1/sqrt(d) scale and the causal mask are folded into the scores
    // and softmax kernels, as fused implementations do.
    const int64_t attn_macs = net.Prod({b, heads, s, s, d}, p + "attn");
    a = net.Matmul(p + "attn.scores", qkv[0], qkv[1], {b, heads, s, s},
                   attn_macs);
    a = net.Softmax(p + "attn.softmax", a);
    a = net.Dropout(p + "attn.attn_dropout", a);
    a = net.Matmul(p + "attn.context", a, qkv[2], {b, heads, s, d}, attn_macs);
    a = net.Contiguous(p + "attn.merge_heads", a, {b, s, h});
    a = net.Linear(p + "attn.c_proj", a, h, true);
    a = net.Dropout(p + "attn.resid_dropout", a);
    x = net.Add(p + "add_1", x, a, /*in_place=*/false);
    int32_t m = net.LayerNorm(p + "ln_2", x);
    m = net.Linear(p + "mlp.c_fc", m, 4 * h, true);
    m = net.Gelu(p + "mlp.gelu", m);
    m = net.Linear(p + "mlp.c_proj", m, h, true);
    m = net.Dropout(p + "mlp.dropout", m);
    x = net.Add(p + "add_2", x, m, /*in_place=*/false);
  }
  x = net.LayerNorm("ln_f", x);
  x = net.Linear("lm_head", x, o.gpt_vocab, false, /*shared=*/wte);
  net.NllLoss(net.LogSoftmax("log_softmax", x), labels);
}

absl::Status CheckDevice(const DeviceProfile& device, DType dtype) {
  const double flops =
      dtype == DType::kFp32 ? device.fp32_flops_per_s : device.fp16_flops_per_s;
  if (!(flops > 0) || !std::isfinite(flops)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device profile '", device.name, "' has no usable ",
                     dtype == DType::kFp32 ? "fp32" : "fp16", " rate"));
  }
  if (!(device.memory_bytes_per_s > 0) ||
      !std::isfinite(device.memory_bytes_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device profile '", device.name, "' has no usable memory bandwidth"));
  }
  return absl::OkStatus();
}

absl::Status CheckImage(absl::string_view model, const ModelOptions& o) {
  if (o.height <= 0 || o.width <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(model, ": height and width must be positive, got ",
                     o.height, "x", o.width));
  }
  if (model == "unet" && (o.height % 16 != 0 || o.width % 16 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unet: height and width must be divisible by 16 (four 2x2 pools), "
        "got ",
        o.height, "x", o.width));
  }
  return absl::OkStatus();
}

absl::Status CheckGpt(const ModelOptions& o) {
  const std::array<std::pair<const char*, int>, 5> sizes = {{
      {"gpt_layers", o.gpt_layers},
      {"gpt_hidden", o.gpt_hidden},
      {"gpt_seq", o.gpt_seq},
      {"gpt_heads", o.gpt_heads},
      {"gpt_vocab", o.gpt_vocab},
  }};
  for (const auto& [field, value] : sizes) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpt: ", field, " must be positive, got ", value));
    }
  }
  if (o.gpt_layers > kMaxGptLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt: gpt_layers must be at most ", kMaxGptLayers,
                     ", got ", o.gpt_layers));
  }
  if (o.gpt_hidden % o.gpt_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt: gpt_heads (", o.gpt_heads,
                     ") must divide gpt_hidden (", o.gpt_hidden, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view OptimizerName(Optimizer optimizer) {
  switch (optimizer) {
    case Optimizer::kSgd:
      return "sgd";
    case Optimizer::kSgdMomentum:
      return "momentum";
    case Optimizer::kAdam:
      return "adam";
  }
  return "unknown";
}

absl::StatusOr<Optimizer> ParseOptimizer(absl::string_view name) {
  for (Optimizer o :
       {Optimizer::kSgd, Optimizer::kSgdMomentum, Optimizer::kAdam}) {
    if (name == OptimizerName(o)) return o;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown optimizer '", name, "'; expected sgd, momentum or adam"));
}

std::vector<std::string> ModelNames() {
  return {"resnet50", "resnet101", "resnet152", "densenet121",
          "vgg16",    "unet",      "gpt"};
}

absl::StatusOr<Trace> BuildModelTrace(absl::string_view model,
                                      const ModelOptions& options,
                                      const DeviceProfile& device) {
  const std::vector<std::string> names = ModelNames();
  if (std::find(names.begin(), names.end(), model) == names.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown model '", model, "'; known: ", absl::StrJoin(names, ", ")));
  }
  if (options.batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(model, ": batch must be positive, got ", options.batch));
  }
  if (absl::Status s = CheckDevice(device, options.dtype); !s.ok()) return s;
  const bool gpt = model == "gpt";
  if (absl::Status s = gpt ? CheckGpt(options) : CheckImage(model, options);
      !s.ok()) {
    return s;
  }
  std::string trace_name =
      absl::StrCat(model, "-b", options.batch, "-",
                   options.dtype == DType::kFp32 ? "fp32" : "fp16");
  if (options.optimizer != Optimizer::kSgd) {
    absl::StrAppend(&trace_name, "-", OptimizerName(options.optimizer));
  }
  const std::string what =
      gpt ? std::string(model)
          : absl::StrCat(model, " input ", options.height, "x", options.width);
  LayerNet net(trace_name, what, options.dtype, options.optimizer, device,
               options.grads_set_to_none);
  const int64_t b = options.batch;
  const int64_t h = options.height;
  const int64_t w = options.width;
  if (model == "resnet50") {
    BuildResNet(net, {3, 4, 6, 3}, b, h, w);
  } else if (model == "resnet101") {
    BuildResNet(net, {3, 4, 23, 3}, b, h, w);
  } else if (model == "resnet152") {
    BuildResNet(net, {3, 8, 36, 3}, b, h, w);
  } else if (model == "densenet121") {
    BuildDenseNet121(net, b, h, w);
  } else if (model == "vgg16") {
    BuildVgg16(net, b, h, w);
  } else if (model == "unet") {
    BuildUNet(net, b, h, w);
  } else {
    BuildGpt(net, options);
  }
  return net.Finish();
}

}  // namespace deltad::sim
