#ifndef DELTAD_POLICIES_SIM_LAYER_NET_H_
#define DELTAD_POLICIES_SIM_LAYER_NET_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/trace.h"

// The layers the model traces are built from (model_traces.cc builds the
// networks): each emits its forward ops and records its backward, and
// Finish() makes the iteration. Internal to the model traces; the layers
// are defined in layer_net_layers.cc, the rest in layer_net.cc.
namespace deltad::sim {

using Shape = std::vector<int64_t>;

// Dispatching any op, even a view, takes the framework about a microsecond;
// the floor also keeps every op's time positive at batch 1.
inline constexpr int64_t kMinOpNs = 1000;
// cuDNN's faster convolution algorithms want scratch of the order of the
// output; the cap keeps that guess from dominating the largest layers.
inline constexpr int64_t kConvWorkspaceCap = int64_t{64} << 20;
inline constexpr int64_t kIndexBytes = 8;  // int64 labels, tokens, indices
inline constexpr int64_t kMaskBytes = 1;   // bool dropout mask
// Batch and layer norm keep mean and inverse std in fp32 even for fp16
// inputs (their accumulate type).
inline constexpr int64_t kStatBytes = 4;

// A network under construction: emits forward ops as layers are added and
// records, per layer, how to emit its backward; Finish() replays those in
// reverse, appends the optimizer step and places every release.
class LayerNet {
 public:
  LayerNet(std::string trace_name, std::string what, DType dtype,
           Optimizer optimizer, const DeviceProfile& device,
           bool grads_set_to_none = true)
      : b_(std::move(trace_name)),
        what_(std::move(what)),
        optimizer_(optimizer),
        grads_set_to_none_(grads_set_to_none),
        elem_(DTypeBytes(dtype)),
        flops_(dtype == DType::kFp32 ? device.fp32_flops_per_s
                                     : device.fp16_flops_per_s),
        bandwidth_(device.memory_bytes_per_s) {}

  int64_t elem() const { return elem_; }
  Shape shape(int32_t v) const { return info_[v].shape; }

  // --- Constants: data the iteration reads and the parameters.

  int32_t Data(const std::string& name, const Shape& shape, int64_t elem_bytes);

  // A weight and its gradient buffer (made in backward when gradients are
  // set to None between iterations); returns an index into params_.
  int Param(const std::string& name, int64_t elems);

  // The product of `factors`, or 0 and an error naming `what` when it
  // overflows.
  int64_t Prod(const Shape& factors, const std::string& what);

  // --- Layers. Each emits its forward op(s) now and its backward later.

  int32_t Conv2d(const std::string& name, int32_t x, int64_t out_c, int64_t k,
                 int64_t stride, int64_t pad, bool bias);

  // A 2x2, stride-2 up-convolution: doubles height and width.
  int32_t ConvTranspose2d(const std::string& name, int32_t x, int64_t out_c);

  int32_t BatchNorm2d(const std::string& name, int32_t x);

  // In place, as torchvision's ReLU(inplace=True): the result shares the
  // input's storage and name. It is saved for backward.
  int32_t Relu(const std::string& name, int32_t x);

  int32_t MaxPool2d(const std::string& name, int32_t x, int64_t k,
                    int64_t stride, int64_t pad);

  int32_t AvgPool2d(const std::string& name, int32_t x, int64_t k);

  int32_t AdaptiveAvgPool2d(const std::string& name, int32_t x, int64_t ho,
                            int64_t wo);

  // a + b. In place on `a` for torchvision's `out += identity`. Saves
  // nothing: backward hands the incoming gradient to both inputs unchanged.
  int32_t Add(const std::string& name, int32_t a, int32_t b, bool in_place);

  // Concatenation along channels into a new tensor. Saves nothing; its
  // backward slices the incoming gradient into views, which keep the whole
  // gradient's storage alive while any of them is.
  int32_t Cat(const std::string& name, const std::vector<int32_t>& xs);

  // Over the last dimension; a 4-d input is flattened per sample first.
  // `shared` reuses another layer's weight (tied embeddings).
  int32_t Linear(const std::string& name, int32_t x, int64_t out_features,
                 bool bias, int shared = -1);

  int32_t Dropout(const std::string& name, int32_t x);

  // Over the last dimension.
  int32_t LayerNorm(const std::string& name, int32_t x);

  // Elementwise with a new output; GELU saves its input, softmax and
  // log-softmax their output.
  int32_t Gelu(const std::string& name, int32_t x);
  int32_t Softmax(const std::string& name, int32_t x);
  int32_t LogSoftmax(const std::string& name, int32_t x);

  // Batched matrix product of `a` and `b` (either possibly transposed
  // views): saves both.
  int32_t Matmul(const std::string& name, int32_t a, int32_t b,
                 const Shape& out, int64_t macs);

  // Views of `x` (e.g. q, k and v of a fused projection), each of logical
  // shape `part`. Backward concatenates their gradients into a new tensor.
  std::vector<int32_t> Split(const std::string& name, int32_t x,
                             const std::vector<std::string>& parts,
                             const Shape& part);

  // A contiguous copy of a permuted view (heads merged back). Backward is
  // a view of the incoming gradient: no kernel.
  int32_t Contiguous(const std::string& name, int32_t x, const Shape& out);

  int32_t Embedding(const std::string& name, int32_t indices, int table,
                    const Shape& out);

  // x + pos with pos broadcast over the batch: the position gradient is the
  // incoming one summed over the batch.
  int32_t AddBroadcast(const std::string& name, int32_t x, int32_t pos);

  // Mean negative log-likelihood of `labels` under `log_probs`: the
  // iteration's loss, whose backward starts the backward pass.
  void NllLoss(int32_t log_probs, int32_t labels);

  // Emits the backward pass and the optimizer step, places the releases
  // and checks the result.
  absl::StatusOr<Trace> Finish();

 private:
  // torch.optim's step, one op per weight: plain SGD reads the weight and
  // its gradient and writes the weight; momentum also reads and writes a
  // momentum buffer per weight, Adam two moment estimates (exp_avg,
  // exp_avg_sq), in the weight's dtype. Adam's default multi-tensor path
  // (torch/optim/adam.py, _multi_tensor_adam) also makes the square roots
  // of exp_avg_sq as new tensors, one weight's worth in all, before the
  // update ("optimizer_step_sqrt"), which every weight's op reads.
  void OptimizerStep();

  struct Info {
    std::string name;  // logical: a version is named after its op
    Shape shape;
    int64_t bytes = 0;  // logical: a view counts its own elements
    int64_t elem_bytes = 0;
    bool requires_grad = false;
  };
  struct ParamIds {
    int32_t weight;  // current version
    int32_t grad;    // current version; -1 until backward makes it
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

  void Defer(Bwd bwd);

  void Backward(const Bwd& bwd);

  int32_t GradOf(int32_t x) const;

  // Adds a contribution to x's gradient as autograd's input buffer does:
  // in place into a gradient this tensor owns, else into a new tensor.
  void AddGrad(int32_t x, int32_t g, bool owned);

  int32_t ConvLike(const char* op, const std::string& name, int32_t x,
                   const Shape& out, int64_t macs, int w, int b);

  // Average pools save their input (PyTorch's backward takes it).
  int32_t Pool(const char* op, const std::string& name, int32_t x,
               const Shape& out);

  int32_t Unary(const char* op, const std::string& name, int32_t x,
                bool saves_output);

  // --- Values. All go through these so that info_ covers every index.

  void SetInfo(int32_t v, Info info);

  int32_t NewOutput(const std::string& name, const Shape& shape,
                    int64_t elem_bytes, bool requires_grad);

  int32_t NewAlias(const std::string& name, int32_t base, const Shape& shape,
                   bool requires_grad = false);

  // The trace keeps the base's name; `name` (made unique) names the new
  // content, e.g. for its gradient.
  int32_t NewVersion(int32_t base, const std::string& name, bool requires_grad);

  std::string Unique(const std::string& name);

  // --- Sizes and times.

  void Fail(std::string message);

  int64_t Bytes(const std::string& name, const Shape& shape,
                int64_t elem_bytes);

  // Output length of a sliding window (floor mode); 0 when it does not fit.
  static int64_t Window(int64_t in, int64_t k, int64_t stride, int64_t pad);

  void CheckSpatial(const std::string& name, const Shape& in, int64_t ho,
                    int64_t wo);

  // Whole nanoseconds, at least `floor_ns`.
  static int64_t Ns(double seconds, int64_t floor_ns = kMinOpNs);
  int64_t DenseNs(int64_t macs) const;
  int64_t MemNs(double bytes, int64_t floor_ns = kMinOpNs) const {
    return Ns(bytes / bandwidth_, floor_ns);
  }

  // A forward value is dropped right after the last op that reads it (or
  // that makes it, if none does); a value updated in place passes that to
  // its newest version. Constants and their versions stay.
  static void PlaceReleases(Trace& trace);

  TraceBuilder b_;
  std::string what_;  // model and input, for messages
  Optimizer optimizer_;
  bool grads_set_to_none_;
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

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_LAYER_NET_H_
