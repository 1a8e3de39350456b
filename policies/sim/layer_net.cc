#include "policies/sim/layer_net.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace deltad::sim {

int32_t LayerNet::Data(const std::string& name, const Shape& shape,
                       int64_t elem_bytes) {
  const int64_t bytes = Bytes(name, shape, elem_bytes);
  const std::string unique = Unique(name);
  const int32_t v = b_.Constant(unique, bytes);
  SetInfo(v, {unique, shape, bytes, elem_bytes, false});
  return v;
}

int LayerNet::Param(const std::string& name, int64_t elems) {
  const int32_t weight = Data(name, {elems}, elem_);
  const int32_t grad =
      grads_set_to_none_ ? -1 : Data(name + ".grad", {elems}, elem_);
  params_.push_back({weight, grad, info_[weight].bytes});
  return static_cast<int>(params_.size()) - 1;
}

int64_t LayerNet::Prod(const Shape& factors, const std::string& what) {
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

void LayerNet::OptimizerStep() {
  std::vector<const char*> suffixes;
  if (optimizer_ == Optimizer::kSgdMomentum) suffixes = {".momentum_buffer"};
  if (optimizer_ == Optimizer::kAdam) suffixes = {".exp_avg", ".exp_avg_sq"};
  std::vector<std::vector<int32_t>> state(params_.size());
  int64_t weights = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamIds& p = params_[i];
    // torch.optim skips a parameter whose gradient is None (and makes no
    // state for it): one that no backward op reached.
    if (p.grad < 0) continue;
    for (const char* suffix : suffixes) {
      state[i].push_back(
          Data(info_[p.weight].name + suffix, shape(p.weight), elem_));
    }
    weights += p.bytes;
  }
  // Adam's multi-tensor path (torch/optim/adam.py, _multi_tensor_adam)
  // makes the square roots of exp_avg_sq as new tensors, one weight's
  // worth in all, in one pass before the update, and keeps them until the
  // step ends.
  int32_t roots = -1;
  if (optimizer_ == Optimizer::kAdam && weights > 0) {
    b_.Op("optimizer_step_sqrt", Phase::kBackward, MemNs(2.0 * weights));
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!state[i].empty()) b_.Input(state[i][1]);
    }
    roots = NewOutput("exp_avg_sq_sqrt", {weights / elem_}, elem_, false);
  }
  // One op per weight. The multi-tensor step runs each pass over every
  // weight at once, but what it computes for a weight reads that weight's
  // gradient and state only. One op for all of them would make every
  // weight's new version a child of every gradient and state (1.5M parent
  // links for DenseNet-121 under Adam), which the policies' tables keep
  // and walk, though no weight depends on another's.
  for (size_t i = 0; i < params_.size(); ++i) {
    ParamIds& p = params_[i];
    if (p.grad < 0) continue;
    // Reads the gradient; reads and writes the weight and each state; and
    // Adam reads the weight's square roots.
    const double bytes =
        (3.0 + 2.0 * suffixes.size() + (roots >= 0 ? 1.0 : 0.0)) * p.bytes;
    // Its share of the passes' time: the framework dispatches each pass
    // once for all weights, so no weight pays kMinOpNs of its own.
    b_.Op("optimizer_step", Phase::kBackward, MemNs(bytes, /*floor_ns=*/1));
    b_.Input(p.weight).Input(p.grad);
    for (int32_t v : state[i]) b_.Input(v);
    if (roots >= 0) b_.Input(roots);
    p.weight = NewVersion(p.weight, info_[p.weight].name, false);
    for (int32_t v : state[i]) NewVersion(v, info_[v].name, false);
  }
}

void LayerNet::Defer(Bwd bwd) {
  backward_.push_back([this, bwd = std::move(bwd)] { Backward(bwd); });
}

void LayerNet::Backward(const Bwd& bwd) {
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
    // Accumulating reads and writes the buffer; the first contribution,
    // when gradients are set to None, writes it only.
    for (int p : bwd.params) {
      bytes += (params_[p].grad >= 0 ? 2.0 : 1.0) * params_[p].bytes;
    }
    for (int32_t x : needs) bytes += info_[x].bytes;
    time = MemNs(bytes);
  }
  b_.Op(bwd.name, Phase::kBackward, time, bwd.workspace);
  if (g >= 0) b_.Input(g);
  for (int32_t s : bwd.saved) b_.Input(s);
  for (int w : bwd.weights) b_.Input(params_[w].weight);
  for (int p : bwd.params) {
    // Accumulates into the buffer; the first contribution makes it.
    if (params_[p].grad >= 0) b_.Input(params_[p].grad);
  }
  std::vector<int32_t> made;
  for (int32_t x : needs) {
    made.push_back(NewOutput(info_[x].name + ".grad", info_[x].shape,
                             info_[x].elem_bytes, false));
  }
  for (int p : bwd.params) {
    ParamIds& ids = params_[p];
    ids.grad = ids.grad >= 0 ? NewVersion(ids.grad, info_[ids.grad].name, false)
                             : NewOutput(info_[ids.weight].name + ".grad",
                                         shape(ids.weight), elem_, false);
  }
  for (size_t i = 0; i < needs.size(); ++i) AddGrad(needs[i], made[i], true);
}

int32_t LayerNet::GradOf(int32_t x) const {
  auto it = grads_.find(x);
  return it == grads_.end() ? -1 : it->second.value;
}

void LayerNet::AddGrad(int32_t x, int32_t g, bool owned) {
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
    sum = {NewOutput(xi.name + ".grad", xi.shape, xi.elem_bytes, false), true};
  }
}

int32_t LayerNet::ConvLike(const char* op, const std::string& name, int32_t x,
                           const Shape& out, int64_t macs, int w, int b) {
  const int64_t fwd = DenseNs(macs);
  const int64_t workspace =
      std::min(Bytes(name, out, elem_), kConvWorkspaceCap);
  b_.Op(op, Phase::kForward, fwd, workspace).Input(x).Input(params_[w].weight);
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

int32_t LayerNet::Pool(const char* op, const std::string& name, int32_t x,
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

int32_t LayerNet::Unary(const char* op, const std::string& name, int32_t x,
                        bool saves_output) {
  b_.Op(op, Phase::kForward, MemNs(2.0 * info_[x].bytes)).Input(x);
  const int32_t y = NewOutput(name, shape(x), elem_, info_[x].requires_grad);
  Defer({.name = absl::StrCat(op, "_backward"),
         .out = y,
         .saved = {saves_output ? y : x},
         .grad_inputs = {x}});
  return y;
}

void LayerNet::SetInfo(int32_t v, Info info) {
  if (info_.size() <= static_cast<size_t>(v)) info_.resize(v + 1);
  info_[v] = std::move(info);
}

int32_t LayerNet::NewOutput(const std::string& name, const Shape& shape,
                            int64_t elem_bytes, bool requires_grad) {
  const int64_t bytes = Bytes(name, shape, elem_bytes);
  const std::string unique = Unique(name);
  const int32_t v = b_.Output(unique, bytes);
  SetInfo(v, {unique, shape, bytes, elem_bytes, requires_grad});
  return v;
}

int32_t LayerNet::NewAlias(const std::string& name, int32_t base,
                           const Shape& shape, bool requires_grad) {
  const int64_t elem_bytes = info_[base].elem_bytes;
  const int64_t bytes = Bytes(name, shape, elem_bytes);
  const std::string unique = Unique(name);
  const int32_t v = b_.Alias(unique, base);
  SetInfo(v, {unique, shape, bytes, elem_bytes, requires_grad});
  return v;
}

int32_t LayerNet::NewVersion(int32_t base, const std::string& name,
                             bool requires_grad) {
  Info info = info_[base];
  info.name = name == info.name ? name : Unique(name);
  info.requires_grad = requires_grad;
  const int32_t v = b_.Version(base);
  SetInfo(v, std::move(info));
  return v;
}

std::string LayerNet::Unique(const std::string& name) {
  if (names_.insert(name).second) return name;
  for (int i = 2;; ++i) {
    std::string candidate = absl::StrCat(name, ".", i);
    if (names_.insert(candidate).second) return candidate;
  }
}

void LayerNet::Fail(std::string message) {
  if (status_.ok()) status_ = absl::InvalidArgumentError(std::move(message));
}

int64_t LayerNet::Bytes(const std::string& name, const Shape& shape,
                        int64_t elem_bytes) {
  Shape factors = shape;
  factors.push_back(elem_bytes);
  return Prod(factors, name);
}

int64_t LayerNet::Window(int64_t in, int64_t k, int64_t stride, int64_t pad) {
  if (in + 2 * pad < k) return 0;
  return (in + 2 * pad - k) / stride + 1;
}

void LayerNet::CheckSpatial(const std::string& name, const Shape& in,
                            int64_t ho, int64_t wo) {
  if (ho >= 1 && wo >= 1) return;
  Fail(absl::StrCat(what_, " is too small for the network: '", name,
                    "' would turn ", in[2], "x", in[3], " into ", ho, "x", wo));
}

int64_t LayerNet::Ns(double seconds, int64_t floor_ns) {
  const double ns = std::ceil(seconds * 1e9);
  // Absurd sizes are rejected elsewhere; this only keeps the cast defined.
  if (!(ns < 1e18)) return int64_t{1'000'000'000'000'000'000};
  return std::max(floor_ns, static_cast<int64_t>(ns));
}

int64_t LayerNet::DenseNs(int64_t macs) const {
  return Ns(2.0 * static_cast<double>(macs) / flops_);
}

void LayerNet::PlaceReleases(Trace& trace) {
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

absl::StatusOr<Trace> LayerNet::Finish() {
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

}  // namespace deltad::sim
