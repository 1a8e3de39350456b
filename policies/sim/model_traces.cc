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

namespace deltad::sim {
namespace {

using Shape = std::vector<int64_t>;

// Dispatching any op, even a view, takes the framework about a microsecond;
// the floor also keeps every op's time positive at batch 1.
constexpr int64_t kMinOpNs = 1000;
// cuDNN's faster convolution algorithms want scratch of the order of the
// output; the cap keeps that guess from dominating the largest layers.
constexpr int64_t kConvWorkspaceCap = int64_t{64} << 20;
constexpr int64_t kImageNetClasses = 1000;
constexpr int64_t kUNetClasses = 2;  // Ronneberger et al.: cell / border
constexpr int64_t kIndexBytes = 8;   // int64 labels, tokens, pool indices
constexpr int64_t kMaskBytes = 1;    // bool dropout mask
// Batch and layer norm keep mean and inverse std in fp32 even for fp16
// inputs (their accumulate type).
constexpr int64_t kStatBytes = 4;
// Guards the op count against absurd requests; GPT-3 has 96 layers.
constexpr int kMaxGptLayers = 1000;

// A network under construction: emits forward ops as layers are added and
// records, per layer, how to emit its backward; Finish() replays those in
// reverse, appends the optimizer step and places every release.
class Net {
 public:
  Net(std::string trace_name, std::string what, DType dtype,
      Optimizer optimizer, const DeviceProfile& device)
      : b_(std::move(trace_name)),
        what_(std::move(what)),
        optimizer_(optimizer),
        elem_(DTypeBytes(dtype)),
        flops_(dtype == DType::kFp32 ? device.fp32_flops_per_s
                                     : device.fp16_flops_per_s),
        bandwidth_(device.memory_bytes_per_s) {}

  int64_t elem() const { return elem_; }
  Shape shape(int32_t v) const { return info_[v].shape; }

  // --- Constants: data the iteration reads and the parameters.

  int32_t Data(const std::string& name, const Shape& shape,
               int64_t elem_bytes) {
    const int64_t bytes = Bytes(name, shape, elem_bytes);
    const std::string unique = Unique(name);
    const int32_t v = b_.Constant(unique, bytes);
    SetInfo(v, {unique, shape, bytes, elem_bytes, false});
    return v;
  }

  // A weight and its gradient buffer; returns an index into params_.
  int Param(const std::string& name, int64_t elems) {
    const int32_t weight = Data(name, {elems}, elem_);
    const int32_t grad = Data(name + ".grad", {elems}, elem_);
    params_.push_back({weight, grad, info_[weight].bytes});
    return static_cast<int>(params_.size()) - 1;
  }

  // The product of `factors`, or 0 and an error naming `what` when it
  // overflows.
  int64_t Prod(const Shape& factors, const std::string& what) {
    int64_t product = 1;
    for (int64_t f : factors) {
      if (__builtin_mul_overflow(product, f, &product)) {
        Fail(absl::StrCat(what_, ": '", what,
                          "' is too large: its size overflows 64 bits"));
        return 0;
      }
    }
    return product;
  }

  // --- Layers. Each emits its forward op(s) now and its backward later.

  int32_t Conv2d(const std::string& name, int32_t x, int64_t out_c, int64_t k,
                 int64_t stride, int64_t pad, bool bias) {
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

  // A 2x2, stride-2 up-convolution: doubles height and width.
  int32_t ConvTranspose2d(const std::string& name, int32_t x, int64_t out_c) {
    constexpr int64_t k = 2;
    const Shape in = shape(x);
    const Shape out = {in[0], out_c, in[2] * k, in[3] * k};
    const int w = Param(name + ".weight", Prod({in[1], out_c, k, k}, name));
    const int b = Param(name + ".bias", out_c);
    const int64_t macs = Prod({in[0], in[1], in[2], in[3], out_c, k, k}, name);
    return ConvLike("conv_transpose2d", name, x, out, macs, w, b);
  }

  int32_t BatchNorm2d(const std::string& name, int32_t x) {
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

  // In place, as torchvision's ReLU(inplace=True): the result shares the
  // input's storage and name. It is saved for backward.
  int32_t Relu(const std::string& name, int32_t x) {
    b_.Op("relu", Phase::kForward, MemNs(2.0 * info_[x].bytes)).Input(x);
    const int32_t y = NewVersion(x, name, info_[x].requires_grad);
    Defer(
        {.name = "relu_backward", .out = y, .saved = {y}, .grad_inputs = {x}});
    return y;
  }

  int32_t MaxPool2d(const std::string& name, int32_t x, int64_t k,
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
    const int32_t indices =
        NewOutput(name + ".indices", out, kIndexBytes, false);
    Defer({.name = "max_pool2d_backward",
           .out = y,
           .saved = {x, indices},
           .grad_inputs = {x}});
    return y;
  }

  int32_t AvgPool2d(const std::string& name, int32_t x, int64_t k) {
    const Shape in = shape(x);
    const int64_t ho = Window(in[2], k, k, 0);
    const int64_t wo = Window(in[3], k, k, 0);
    CheckSpatial(name, in, ho, wo);
    return Pool("avg_pool2d", name, x, {in[0], in[1], ho, wo});
  }

  int32_t AdaptiveAvgPool2d(const std::string& name, int32_t x, int64_t ho,
                            int64_t wo) {
    const Shape in = shape(x);
    return Pool("adaptive_avg_pool2d", name, x, {in[0], in[1], ho, wo});
  }

  // a + b. In place on `a` for torchvision's `out += identity`. Saves
  // nothing: backward hands the incoming gradient to both inputs unchanged.
  int32_t Add(const std::string& name, int32_t a, int32_t b, bool in_place) {
    const bool rg = info_[a].requires_grad || info_[b].requires_grad;
    b_.Op("add", Phase::kForward, MemNs(3.0 * info_[a].bytes))
        .Input(a)
        .Input(b);
    const int32_t y = in_place ? NewVersion(a, name, rg)
                               : NewOutput(name, shape(a), elem_, rg);
    backward_.push_back([this, y, a, b] {
      const int32_t g = GradOf(y);
      if (g < 0) return;
      if (info_[a].requires_grad) AddGrad(a, g, false);
      if (info_[b].requires_grad) AddGrad(b, g, false);
    });
    return y;
  }

  // Concatenation along channels into a new tensor. Saves nothing; its
  // backward slices the incoming gradient into views, which keep the whole
  // gradient's storage alive while any of them is.
  int32_t Cat(const std::string& name, const std::vector<int32_t>& xs) {
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
        slices.emplace_back(
            x, NewAlias(info_[x].name + ".grad", g, info_[x].shape));
      }
      for (const auto& [x, slice] : slices) AddGrad(x, slice, false);
    });
    return y;
  }

  // Over the last dimension; a 4-d input is flattened per sample first.
  // `shared` reuses another layer's weight (tied embeddings).
  int32_t Linear(const std::string& name, int32_t x, int64_t out_features,
                 bool bias, int shared = -1) {
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

  int32_t Dropout(const std::string& name, int32_t x) {
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

  // Over the last dimension.
  int32_t LayerNorm(const std::string& name, int32_t x) {
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

  // Elementwise with a new output; GELU saves its input, softmax and
  // log-softmax their output.
  int32_t Gelu(const std::string& name, int32_t x) {
    return Unary("gelu", name, x, /*saves_output=*/false);
  }
  int32_t Softmax(const std::string& name, int32_t x) {
    return Unary("softmax", name, x, /*saves_output=*/true);
  }
  int32_t LogSoftmax(const std::string& name, int32_t x) {
    return Unary("log_softmax", name, x, /*saves_output=*/true);
  }

  // Batched matrix product of `a` and `b` (either possibly transposed
  // views): saves both.
  int32_t Matmul(const std::string& name, int32_t a, int32_t b,
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

  // Views of `x` (e.g. q, k and v of a fused projection), each of logical
  // shape `part`. Backward concatenates their gradients into a new tensor.
  std::vector<int32_t> Split(const std::string& name, int32_t x,
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

  // A contiguous copy of a permuted view (heads merged back). Backward is
  // a view of the incoming gradient: no kernel.
  int32_t Contiguous(const std::string& name, int32_t x, const Shape& out) {
    b_.Op("contiguous", Phase::kForward, MemNs(2.0 * info_[x].bytes)).Input(x);
    const int32_t y = NewOutput(name, out, elem_, info_[x].requires_grad);
    backward_.push_back([this, x, y] {
      if (const int32_t g = GradOf(y); g >= 0) AddGrad(x, g, false);
    });
    return y;
  }

  int32_t Embedding(const std::string& name, int32_t indices, int table,
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

  // x + pos with pos broadcast over the batch: the position gradient is the
  // incoming one summed over the batch.
  int32_t AddBroadcast(const std::string& name, int32_t x, int32_t pos) {
    b_.Op("add", Phase::kForward,
          MemNs(2.0 * info_[x].bytes + info_[pos].bytes))
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

  // Mean negative log-likelihood of `labels` under `log_probs`: the
  // iteration's loss, whose backward starts the backward pass.
  void NllLoss(int32_t log_probs, int32_t labels) {
    b_.Op("nll_loss", Phase::kForward,
          MemNs(static_cast<double>(info_[labels].bytes) * 2))
        .Input(log_probs)
        .Input(labels);
    NewOutput("loss", {1}, elem_, true);
    Defer({.name = "nll_loss_backward",
           .saved = {log_probs, labels},
           .grad_inputs = {log_probs}});
  }

  // Emits the backward pass and the optimizer step, places the releases
  // and checks the result.
  absl::StatusOr<Trace> Finish() {
    for (auto it = backward_.rbegin(); it != backward_.rend(); ++it) (*it)();
    OptimizerStep();
    if (!status_.ok()) return status_;
    Trace trace = std::move(b_).Build();
    PlaceReleases(trace);
    if (absl::Status s = trace.Validate(); !s.ok()) {
      return absl::InternalError(absl::StrCat("generated trace '", trace.name,
                                              "' is invalid: ", s.message()));
    }
    return trace;
  }

 private:
  // torch.optim's step over every weight: plain SGD reads the weight and its
  // gradient and writes the weight; momentum also reads and writes a
  // momentum buffer per weight, Adam two moment estimates (exp_avg,
  // exp_avg_sq), in the weight's dtype. Adam's default multi-tensor path
  // (torch/optim/adam.py, _multi_tensor_adam) also makes the square roots
  // of exp_avg_sq as new tensors, one weight's worth in all, for the step.
  void OptimizerStep() {
    std::vector<const char*> suffixes;
    if (optimizer_ == Optimizer::kSgdMomentum) suffixes = {".momentum_buffer"};
    if (optimizer_ == Optimizer::kAdam) suffixes = {".exp_avg", ".exp_avg_sq"};
    std::vector<std::vector<int32_t>> state(params_.size());
    double bytes = 0;
    int64_t weights = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const ParamIds& p = params_[i];
      for (const char* suffix : suffixes) {
        state[i].push_back(
            Data(info_[p.weight].name + suffix, shape(p.weight), elem_));
      }
      // Read the gradient; read and write the weight and each state.
      bytes += (3.0 + 2.0 * suffixes.size()) * p.bytes;
      weights += p.bytes;
    }
    const int64_t workspace = optimizer_ == Optimizer::kAdam ? weights : 0;
    b_.Op("optimizer_step", Phase::kBackward, MemNs(bytes), workspace);
    for (size_t i = 0; i < params_.size(); ++i) {
      b_.Input(params_[i].weight).Input(params_[i].grad);
      for (int32_t v : state[i]) b_.Input(v);
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      ParamIds& p = params_[i];
      p.weight = NewVersion(p.weight, info_[p.weight].name, false);
      for (int32_t v : state[i]) NewVersion(v, info_[v].name, false);
    }
  }

  struct Info {
    std::string name;  // logical: a version is named after its op
    Shape shape;
    int64_t bytes = 0;  // logical: a view counts its own elements
    int64_t elem_bytes = 0;
    bool requires_grad = false;
  };
  struct ParamIds {
    int32_t weight;  // current version
    int32_t grad;    // current version
    int64_t bytes;
  };
  struct Grad {
    int32_t value = -1;
    // Made for this tensor alone, so later contributions may be summed
    // into it in place; a gradient passed through unchanged is shared.
    bool owned = false;
  };
  // One backward op: reads the gradient of `out` (none for the loss), the
  // saved tensors and `weights`; produces gradients for those `grad_inputs`
  // that need one and accumulates into the gradient buffers of `params`.
  struct Bwd {
    std::string name = {};
    int64_t time_ns = -1;  // -1: memory bound, from the bytes it touches
    int64_t workspace = 0;
    int32_t out = -1;
    std::vector<int32_t> saved = {};
    std::vector<int32_t> grad_inputs = {};
    std::vector<int> params = {};
    std::vector<int> weights = {};
  };

  void Defer(Bwd bwd) {
    backward_.push_back([this, bwd = std::move(bwd)] { Backward(bwd); });
  }

  void Backward(const Bwd& bwd) {
    int32_t g = -1;
    if (bwd.out >= 0) {
      g = GradOf(bwd.out);
      if (g < 0) return;  // nothing downstream reached the loss
    }
    std::vector<int32_t> needs;
    for (int32_t x : bwd.grad_inputs) {
      if (info_[x].requires_grad) needs.push_back(x);
    }
    int64_t time = bwd.time_ns;
    if (time < 0) {
      double bytes = g >= 0 ? info_[g].bytes : 0;
      for (int32_t s : bwd.saved) bytes += info_[s].bytes;
      for (int w : bwd.weights) bytes += params_[w].bytes;
      for (int p : bwd.params) bytes += 2.0 * params_[p].bytes;
      for (int32_t x : needs) bytes += info_[x].bytes;
      time = MemNs(bytes);
    }
    b_.Op(bwd.name, Phase::kBackward, time, bwd.workspace);
    if (g >= 0) b_.Input(g);
    for (int32_t s : bwd.saved) b_.Input(s);
    for (int w : bwd.weights) b_.Input(params_[w].weight);
    for (int p : bwd.params) b_.Input(params_[p].grad);
    std::vector<int32_t> made;
    for (int32_t x : needs) {
      made.push_back(NewOutput(info_[x].name + ".grad", info_[x].shape,
                               info_[x].elem_bytes, false));
    }
    for (int p : bwd.params) {
      ParamIds& ids = params_[p];
      ids.grad = NewVersion(ids.grad, info_[ids.grad].name, false);
    }
    for (size_t i = 0; i < needs.size(); ++i) AddGrad(needs[i], made[i], true);
  }

  int32_t GradOf(int32_t x) const {
    auto it = grads_.find(x);
    return it == grads_.end() ? -1 : it->second.value;
  }

  // Adds a contribution to x's gradient as autograd's input buffer does:
  // in place into a gradient this tensor owns, else into a new tensor.
  void AddGrad(int32_t x, int32_t g, bool owned) {
    auto [it, inserted] = grads_.try_emplace(x, Grad{g, owned});
    if (inserted) return;
    Grad& sum = it->second;
    const Info& xi = info_[x];
    b_.Op("add", Phase::kBackward, MemNs(3.0 * xi.bytes))
        .Input(sum.value)
        .Input(g);
    if (sum.owned) {
      sum.value = NewVersion(sum.value, info_[sum.value].name, false);
    } else if (owned) {
      sum = {NewVersion(g, info_[g].name, false), true};
    } else {
      sum = {NewOutput(xi.name + ".grad", xi.shape, xi.elem_bytes, false),
             true};
    }
  }

  int32_t ConvLike(const char* op, const std::string& name, int32_t x,
                   const Shape& out, int64_t macs, int w, int b) {
    const int64_t fwd = DenseNs(macs);
    const int64_t workspace =
        std::min(Bytes(name, out, elem_), kConvWorkspaceCap);
    b_.Op(op, Phase::kForward, fwd, workspace)
        .Input(x)
        .Input(params_[w].weight);
    if (b >= 0) b_.Input(params_[b].weight);
    const int32_t y = NewOutput(name, out, elem_, true);
    Bwd bwd{.name = absl::StrCat(op, "_backward"),
            .time_ns = 2 * fwd,
            .workspace = workspace,
            .out = y,
            .saved = {x},
            .grad_inputs = {x},
            .params = {w},
            .weights = {w}};
    if (b >= 0) bwd.params.push_back(b);
    Defer(std::move(bwd));
    return y;
  }

  // Average pools save their input (PyTorch's backward takes it).
  int32_t Pool(const char* op, const std::string& name, int32_t x,
               const Shape& out) {
    const int64_t out_bytes = Bytes(name, out, elem_);
    b_.Op(op, Phase::kForward,
          MemNs(static_cast<double>(info_[x].bytes) + out_bytes))
        .Input(x);
    const int32_t y = NewOutput(name, out, elem_, info_[x].requires_grad);
    Defer({.name = absl::StrCat(op, "_backward"),
           .out = y,
           .saved = {x},
           .grad_inputs = {x}});
    return y;
  }

  int32_t Unary(const char* op, const std::string& name, int32_t x,
                bool saves_output) {
    b_.Op(op, Phase::kForward, MemNs(2.0 * info_[x].bytes)).Input(x);
    const int32_t y = NewOutput(name, shape(x), elem_, info_[x].requires_grad);
    Defer({.name = absl::StrCat(op, "_backward"),
           .out = y,
           .saved = {saves_output ? y : x},
           .grad_inputs = {x}});
    return y;
  }

  // --- Values. All go through these so that info_ covers every index.

  void SetInfo(int32_t v, Info info) {
    if (info_.size() <= static_cast<size_t>(v)) info_.resize(v + 1);
    info_[v] = std::move(info);
  }

  int32_t NewOutput(const std::string& name, const Shape& shape,
                    int64_t elem_bytes, bool requires_grad) {
    const int64_t bytes = Bytes(name, shape, elem_bytes);
    const std::string unique = Unique(name);
    const int32_t v = b_.Output(unique, bytes);
    SetInfo(v, {unique, shape, bytes, elem_bytes, requires_grad});
    return v;
  }

  int32_t NewAlias(const std::string& name, int32_t base, const Shape& shape,
                   bool requires_grad = false) {
    const int64_t elem_bytes = info_[base].elem_bytes;
    const int64_t bytes = Bytes(name, shape, elem_bytes);
    const std::string unique = Unique(name);
    const int32_t v = b_.Alias(unique, base);
    SetInfo(v, {unique, shape, bytes, elem_bytes, requires_grad});
    return v;
  }

  // The trace keeps the base's name; `name` (made unique) names the new
  // content, e.g. for its gradient.
  int32_t NewVersion(int32_t base, const std::string& name,
                     bool requires_grad) {
    Info info = info_[base];
    info.name = name == info.name ? name : Unique(name);
    info.requires_grad = requires_grad;
    const int32_t v = b_.Version(base);
    SetInfo(v, std::move(info));
    return v;
  }

  std::string Unique(const std::string& name) {
    if (names_.insert(name).second) return name;
    for (int i = 2;; ++i) {
      std::string candidate = absl::StrCat(name, ".", i);
      if (names_.insert(candidate).second) return candidate;
    }
  }

  // --- Sizes and times.

  void Fail(std::string message) {
    if (status_.ok()) status_ = absl::InvalidArgumentError(std::move(message));
  }

  int64_t Bytes(const std::string& name, const Shape& shape,
                int64_t elem_bytes) {
    Shape factors = shape;
    factors.push_back(elem_bytes);
    return Prod(factors, name);
  }

  // Output length of a sliding window (floor mode); 0 when it does not fit.
  static int64_t Window(int64_t in, int64_t k, int64_t stride, int64_t pad) {
    if (in + 2 * pad < k) return 0;
    return (in + 2 * pad - k) / stride + 1;
  }

  void CheckSpatial(const std::string& name, const Shape& in, int64_t ho,
                    int64_t wo) {
    if (ho >= 1 && wo >= 1) return;
    Fail(absl::StrCat(what_, " is too small for the network: '", name,
                      "' would turn ", in[2], "x", in[3], " into ", ho, "x",
                      wo));
  }

  static int64_t Ns(double seconds) {
    const double ns = std::ceil(seconds * 1e9);
    // Absurd sizes are rejected elsewhere; this only keeps the cast defined.
    if (!(ns < 1e18)) return int64_t{1'000'000'000'000'000'000};
    return std::max(kMinOpNs, static_cast<int64_t>(ns));
  }
  int64_t DenseNs(int64_t macs) const {
    return Ns(2.0 * static_cast<double>(macs) / flops_);
  }
  int64_t MemNs(double bytes) const { return Ns(bytes / bandwidth_); }

  // A forward value is dropped right after the last op that reads it (or
  // that makes it, if none does); a value updated in place passes that to
  // its newest version. Constants and their versions stay.
  static void PlaceReleases(Trace& trace) {
    using Kind = TraceValue::Kind;
    const size_t n = trace.values.size();
    std::vector<int32_t> last(n, -1);
    for (size_t i = 0; i < trace.ops.size(); ++i) {
      for (int32_t v : trace.ops[i].inputs) {
        last[v] = static_cast<int32_t>(i);
      }
    }
    std::vector<bool> superseded(n, false);
    for (const TraceValue& v : trace.values) {
      if (v.kind == Kind::kVersion) superseded[v.base] = true;
    }
    for (size_t v = 0; v < n; ++v) {
      size_t root = v;
      while (trace.values[root].kind == Kind::kVersion) {
        root = trace.values[root].base;
      }
      if (trace.values[root].kind == Kind::kConstant || superseded[v]) {
        continue;
      }
      const int32_t at = std::max(trace.values[v].op, last[v]);
      trace.ops[at].releases.push_back(static_cast<int32_t>(v));
    }
  }

  TraceBuilder b_;
  std::string what_;  // model and input, for messages
  Optimizer optimizer_;
  int64_t elem_;
  double flops_;
  double bandwidth_;
  absl::Status status_;
  std::vector<Info> info_;  // by value index
  std::vector<ParamIds> params_;
  absl::flat_hash_map<int32_t, Grad> grads_;  // by forward value index
  absl::flat_hash_set<std::string> names_;
  std::vector<std::function<void()>> backward_;
};

// --- Networks.

// Image classifiers end in log-softmax and NLL over ImageNet's classes, as
// F.cross_entropy does.
void ClassificationLoss(Net& net, int32_t logits, int32_t labels) {
  net.NllLoss(net.LogSoftmax("log_softmax", logits), labels);
}

int32_t ConvBnRelu(Net& net, const std::string& prefix, const std::string& n,
                   int32_t x, int64_t out_c, int64_t k, int64_t stride,
                   int64_t pad) {
  int32_t y = net.Conv2d(prefix + "conv" + n, x, out_c, k, stride, pad, false);
  y = net.BatchNorm2d(prefix + "bn" + n, y);
  return net.Relu(prefix + "relu" + n, y);
}

// torchvision ResNet with Bottleneck blocks (v1.5: stride on the 3x3).
void BuildResNet(Net& net, const std::array<int, 4>& blocks, int64_t batch,
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
void BuildDenseNet121(Net& net, int64_t batch, int64_t height, int64_t width) {
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
void BuildVgg16(Net& net, int64_t batch, int64_t height, int64_t width) {
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

int32_t DoubleConv(Net& net, const std::string& p, int32_t x, int64_t out_c) {
  x = net.Relu(p + ".relu1", net.Conv2d(p + ".conv1", x, out_c, 3, 1, 1, true));
  return net.Relu(p + ".relu2",
                  net.Conv2d(p + ".conv2", x, out_c, 3, 1, 1, true));
}

// U-Net after Ronneberger et al. (2015) with padded convolutions: no batch
// norm, biased 3x3 convolutions, 2x2 up-convolutions, skip features first
// in each concatenation, a 1x1 head to two classes and a per-pixel loss.
void BuildUNet(Net& net, int64_t batch, int64_t height, int64_t width) {
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
void BuildGpt(Net& net, const ModelOptions& o) {
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
  Net net(trace_name, what, options.dtype, options.optimizer, device);
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
