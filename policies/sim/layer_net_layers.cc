#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/sim/layer_net.h"

// The layers, each its forward op(s) now and its backward recorded for
// Finish().
namespace deltad::sim {

int32_t LayerNet::Conv2d(const std::string& name, int32_t x, int64_t out_c,
                         int64_t k, int64_t stride, int64_t pad, bool bias) {
  const Shape in = shape(x);
  const int64_t ho = Window(in[2], k, stride, pad);
  const int64_t wo = Window(in[3], k, stride, pad);
  CheckSpatial(name, in, ho, wo);
  const Shape out = {in[0], out_c, ho, wo};
  const int w = Param(name + ".weight", Prod({out_c, in[1], k, k}, name));
  const int b = bias ? Param(name + ".bias", out_c) : -1;
  const int64_t macs = Prod({in[0], out_c, ho, wo, in[1], k, k}, name);
  return ConvLike("conv2d", name, x, out, macs, w, b);
}

int32_t LayerNet::ConvTranspose2d(const std::string& name, int32_t x,
                                  int64_t out_c) {
  constexpr int64_t k = 2;
  const Shape in = shape(x);
  const Shape out = {in[0], out_c, in[2] * k, in[3] * k};
  const int w = Param(name + ".weight", Prod({in[1], out_c, k, k}, name));
  const int b = Param(name + ".bias", out_c);
  const int64_t macs = Prod({in[0], in[1], in[2], in[3], out_c, k, k}, name);
  return ConvLike("conv_transpose2d", name, x, out, macs, w, b);
}

int32_t LayerNet::BatchNorm2d(const std::string& name, int32_t x) {
  const Shape in = shape(x);
  const int64_t c = in[1];
  const int w = Param(name + ".weight", c);
  const int b = Param(name + ".bias", c);
  const int32_t mean = Data(name + ".running_mean", {c}, elem_);
  const int32_t var = Data(name + ".running_var", {c}, elem_);
  const int64_t bytes = info_[x].bytes;
  b_.Op("batch_norm", Phase::kForward, MemNs(2.0 * bytes))
      .Input(x)
      .Input(params_[w].weight)
      .Input(params_[b].weight)
      .Input(mean)
      .Input(var);
  const int32_t y = NewOutput(name, in, elem_, true);
  const int32_t stats = NewOutput(name + ".stats", {2, c}, kStatBytes, false);
  // Training mode refreshes the running statistics in place.
  NewVersion(mean, name + ".running_mean", false);
  NewVersion(var, name + ".running_var", false);
  Defer({.name = "batch_norm_backward",
         .out = y,
         .saved = {x, stats},
         .grad_inputs = {x},
         .params = {w, b},
         .weights = {w}});
  return y;
}

int32_t LayerNet::Relu(const std::string& name, int32_t x) {
  b_.Op("relu", Phase::kForward, MemNs(2.0 * info_[x].bytes)).Input(x);
  const int32_t y = NewVersion(x, name, info_[x].requires_grad);
  Defer({.name = "relu_backward", .out = y, .saved = {y}, .grad_inputs = {x}});
  return y;
}

int32_t LayerNet::MaxPool2d(const std::string& name, int32_t x, int64_t k,
                            int64_t stride, int64_t pad) {
  const Shape in = shape(x);
  const int64_t ho = Window(in[2], k, stride, pad);
  const int64_t wo = Window(in[3], k, stride, pad);
  CheckSpatial(name, in, ho, wo);
  const Shape out = {in[0], in[1], ho, wo};
  const int64_t out_bytes = Bytes(name, out, elem_);
  const int64_t index_bytes = Bytes(name, out, kIndexBytes);
  b_.Op("max_pool2d", Phase::kForward,
        MemNs(static_cast<double>(info_[x].bytes) + out_bytes + index_bytes))
      .Input(x);
  const int32_t y = NewOutput(name, out, elem_, info_[x].requires_grad);
  const int32_t indices = NewOutput(name + ".indices", out, kIndexBytes, false);
  Defer({.name = "max_pool2d_backward",
         .out = y,
         .saved = {x, indices},
         .grad_inputs = {x}});
  return y;
}

int32_t LayerNet::AvgPool2d(const std::string& name, int32_t x, int64_t k) {
  const Shape in = shape(x);
  const int64_t ho = Window(in[2], k, k, 0);
  const int64_t wo = Window(in[3], k, k, 0);
  CheckSpatial(name, in, ho, wo);
  return Pool("avg_pool2d", name, x, {in[0], in[1], ho, wo});
}

int32_t LayerNet::AdaptiveAvgPool2d(const std::string& name, int32_t x,
                                    int64_t ho, int64_t wo) {
  const Shape in = shape(x);
  return Pool("adaptive_avg_pool2d", name, x, {in[0], in[1], ho, wo});
}

int32_t LayerNet::Add(const std::string& name, int32_t a, int32_t b,
                      bool in_place) {
  const bool rg = info_[a].requires_grad || info_[b].requires_grad;
  b_.Op("add", Phase::kForward, MemNs(3.0 * info_[a].bytes)).Input(a).Input(b);
  const int32_t y =
      in_place ? NewVersion(a, name, rg) : NewOutput(name, shape(a), elem_, rg);
  backward_.push_back([this, y, a, b] {
    const int32_t g = GradOf(y);
    if (g < 0) return;
    if (info_[a].requires_grad) AddGrad(a, g, false);
    if (info_[b].requires_grad) AddGrad(b, g, false);
  });
  return y;
}

int32_t LayerNet::Cat(const std::string& name, const std::vector<int32_t>& xs) {
  Shape out = shape(xs[0]);
  out[1] = 0;
  bool rg = false;
  for (int32_t x : xs) {
    out[1] += info_[x].shape[1];
    rg = rg || info_[x].requires_grad;
  }
  const int64_t bytes = Bytes(name, out, elem_);
  b_.Op("cat", Phase::kForward, MemNs(2.0 * bytes));
  for (int32_t x : xs) b_.Input(x);
  const int32_t y = NewOutput(name, out, elem_, rg);
  backward_.push_back([this, y, xs] {
    const int32_t g = GradOf(y);
    if (g < 0) return;
    b_.Op("cat_backward", Phase::kBackward, kMinOpNs).Input(g);
    std::vector<std::pair<int32_t, int32_t>> slices;
    for (int32_t x : xs) {
      if (!info_[x].requires_grad) continue;
      slices.emplace_back(x,
                          NewAlias(info_[x].name + ".grad", g, info_[x].shape));
    }
    for (const auto& [x, slice] : slices) AddGrad(x, slice, false);
  });
  return y;
}

int32_t LayerNet::Linear(const std::string& name, int32_t x,
                         int64_t out_features, bool bias, int shared) {
  const Shape in = shape(x);
  int64_t rows = 0;
  int64_t in_features = 0;
  Shape out;
  if (in.size() == 4) {
    rows = in[0];
    in_features = Prod({in[1], in[2], in[3]}, name);
    out = {rows, out_features};
  } else {
    in_features = in.back();
    rows = Prod(Shape(in.begin(), in.end() - 1), name);
    out = in;
    out.back() = out_features;
  }
  const int w = shared >= 0 ? shared
                            : Param(name + ".weight",
                                    Prod({in_features, out_features}, name));
  const int b = bias ? Param(name + ".bias", out_features) : -1;
  const int64_t fwd = DenseNs(Prod({rows, in_features, out_features}, name));
  b_.Op("linear", Phase::kForward, fwd).Input(x).Input(params_[w].weight);
  if (b >= 0) b_.Input(params_[b].weight);
  const int32_t y = NewOutput(name, out, elem_, true);
  Bwd bwd{.name = "linear_backward",
          .time_ns = 2 * fwd,
          .out = y,
          .saved = {x},
          .grad_inputs = {x},
          .params = {w},
          .weights = {w}};
  if (b >= 0) bwd.params.push_back(b);
  Defer(std::move(bwd));
  return y;
}

int32_t LayerNet::Dropout(const std::string& name, int32_t x) {
  const Shape in = shape(x);
  const int64_t mask_bytes = Bytes(name, in, kMaskBytes);
  b_.Op("dropout", Phase::kForward, MemNs(2.0 * info_[x].bytes + mask_bytes))
      .Input(x);
  const int32_t y = NewOutput(name, in, elem_, info_[x].requires_grad);
  const int32_t mask = NewOutput(name + ".mask", in, kMaskBytes, false);
  Defer({.name = "dropout_backward",
         .out = y,
         .saved = {mask},
         .grad_inputs = {x}});
  return y;
}

int32_t LayerNet::LayerNorm(const std::string& name, int32_t x) {
  const Shape in = shape(x);
  const int w = Param(name + ".weight", in.back());
  const int b = Param(name + ".bias", in.back());
  const int64_t rows = Prod(Shape(in.begin(), in.end() - 1), name);
  b_.Op("layer_norm", Phase::kForward, MemNs(2.0 * info_[x].bytes))
      .Input(x)
      .Input(params_[w].weight)
      .Input(params_[b].weight);
  const int32_t y = NewOutput(name, in, elem_, true);
  const int32_t stats =
      NewOutput(name + ".stats", {2, rows}, kStatBytes, false);
  Defer({.name = "layer_norm_backward",
         .out = y,
         .saved = {x, stats},
         .grad_inputs = {x},
         .params = {w, b},
         .weights = {w}});
  return y;
}

int32_t LayerNet::Gelu(const std::string& name, int32_t x) {
  return Unary("gelu", name, x, /*saves_output=*/false);
}

int32_t LayerNet::Softmax(const std::string& name, int32_t x) {
  return Unary("softmax", name, x, /*saves_output=*/true);
}

int32_t LayerNet::LogSoftmax(const std::string& name, int32_t x) {
  return Unary("log_softmax", name, x, /*saves_output=*/true);
}

int32_t LayerNet::Matmul(const std::string& name, int32_t a, int32_t b,
                         const Shape& out, int64_t macs) {
  const int64_t fwd = DenseNs(macs);
  b_.Op("matmul", Phase::kForward, fwd).Input(a).Input(b);
  const int32_t y = NewOutput(name, out, elem_, true);
  Defer({.name = "matmul_backward",
         .time_ns = 2 * fwd,
         .out = y,
         .saved = {a, b},
         .grad_inputs = {a, b}});
  return y;
}

std::vector<int32_t> LayerNet::Split(const std::string& name, int32_t x,
                                     const std::vector<std::string>& parts,
                                     const Shape& part) {
  b_.Op("split", Phase::kForward, kMinOpNs).Input(x);
  std::vector<int32_t> views;
  for (const std::string& p : parts) {
    views.push_back(NewAlias(name + "." + p, x, part, true));
  }
  backward_.push_back([this, x, views] {
    std::vector<int32_t> gs;
    for (int32_t v : views) {
      if (const int32_t g = GradOf(v); g >= 0) gs.push_back(g);
    }
    if (gs.empty()) return;
    const int64_t bytes = info_[x].bytes;
    b_.Op("split_backward", Phase::kBackward, MemNs(2.0 * bytes));
    for (int32_t g : gs) b_.Input(g);
    const int32_t gx = NewOutput(info_[x].name + ".grad", info_[x].shape,
                                 info_[x].elem_bytes, false);
    AddGrad(x, gx, true);
  });
  return views;
}

int32_t LayerNet::Contiguous(const std::string& name, int32_t x,
                             const Shape& out) {
  b_.Op("contiguous", Phase::kForward, MemNs(2.0 * info_[x].bytes)).Input(x);
  const int32_t y = NewOutput(name, out, elem_, info_[x].requires_grad);
  backward_.push_back([this, x, y] {
    if (const int32_t g = GradOf(y); g >= 0) AddGrad(x, g, false);
  });
  return y;
}

int32_t LayerNet::Embedding(const std::string& name, int32_t indices, int table,
                            const Shape& out) {
  const int64_t out_bytes = Bytes(name, out, elem_);
  b_.Op("embedding", Phase::kForward,
        MemNs(2.0 * out_bytes + info_[indices].bytes))
      .Input(params_[table].weight)
      .Input(indices);
  const int32_t y = NewOutput(name, out, elem_, true);
  Defer({.name = "embedding_backward",
         .out = y,
         .saved = {indices},
         .params = {table}});
  return y;
}

int32_t LayerNet::AddBroadcast(const std::string& name, int32_t x,
                               int32_t pos) {
  b_.Op("add", Phase::kForward, MemNs(2.0 * info_[x].bytes + info_[pos].bytes))
      .Input(x)
      .Input(pos);
  const int32_t y = NewOutput(name, shape(x), elem_, true);
  backward_.push_back([this, x, y, pos] {
    const int32_t g = GradOf(y);
    if (g < 0) return;
    AddGrad(x, g, false);
    b_.Op("sum", Phase::kBackward,
          MemNs(static_cast<double>(info_[g].bytes) + info_[pos].bytes))
        .Input(g);
    AddGrad(pos,
            NewOutput(info_[pos].name + ".grad", info_[pos].shape,
                      info_[pos].elem_bytes, false),
            true);
  });
  return y;
}

void LayerNet::NllLoss(int32_t log_probs, int32_t labels) {
  b_.Op("nll_loss", Phase::kForward,
        MemNs(static_cast<double>(info_[labels].bytes) * 2))
      .Input(log_probs)
      .Input(labels);
  NewOutput("loss", {1}, elem_, true);
  Defer({.name = "nll_loss_backward",
         .saved = {log_probs, labels},
         .grad_inputs = {log_probs}});
}

}  // namespace deltad::sim
