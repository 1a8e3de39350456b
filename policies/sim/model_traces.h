#ifndef DELTAD_POLICIES_SIM_MODEL_TRACES_H_
#define DELTAD_POLICIES_SIM_MODEL_TRACES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/trace.h"

namespace deltad::sim {

// torch.optim's optimizer whose step ends the iteration: plain SGD, SGD
// with momentum (one buffer per weight) or Adam (two).
enum class Optimizer : uint8_t { kSgd, kSgdMomentum, kAdam };
// "sgd", "momentum", "adam".
absl::string_view OptimizerName(Optimizer optimizer);
absl::StatusOr<Optimizer> ParseOptimizer(absl::string_view name);

// Shapes of the generated networks. Image models read batch, dtype, height
// and width; "gpt" reads batch, dtype and the gpt_* fields.
struct ModelOptions {
  int batch = 32;
  DType dtype = DType::kFp32;
  int height = 224;
  int width = 224;
  int gpt_layers = 12;
  int gpt_hidden = 768;
  int gpt_seq = 1024;  // also the number of learned positions
  int gpt_heads = 12;
  int gpt_vocab = 50257;
  Optimizer optimizer = Optimizer::kSgd;
  // Gradient buffers as PyTorch 2 keeps them: optimizer.zero_grad() sets
  // them to None by default since PyTorch 2.0 (torch.optim.Optimizer
  // .zero_grad(set_to_none=True)), so each is made by the first backward op
  // that reaches its parameter and dropped after the optimizer step reads
  // it. false: zeroed and kept, the buffers live through every iteration
  // (PyTorch 1.x's default, set_to_none=False).
  bool grads_set_to_none = true;
};

// "resnet50", "resnet101", "resnet152", "densenet121", "vgg16", "unet",
// "gpt".
std::vector<std::string> ModelNames();

// One training iteration of `model` (forward, backward, one optimizer
// step) as a trace named "<model>-b<batch>-<fp32|fp16>", with
// "-<momentum|adam>" after it for those optimizers, timed with `device`'s
// sustained rates. Activation sizes are exact for the layer shapes; what
// each op keeps for backward follows PyTorch autograd, and in-place ReLU
// and residual adds follow torchvision. Naming, which tests and tools may
// rely on:
//   - constants: "input" / "tokens", "labels", parameters "<module>.weight"
//     and "<module>.bias", their gradient buffers "<parameter>.grad" (a
//     constant only with grads_set_to_none false), batch
//     norm buffers "<module>.running_mean" / "<module>.running_var",
//     optimizer state "<parameter>.momentum_buffer" or "<parameter>.exp_avg"
//     and "<parameter>.exp_avg_sq";
//   - activations are named after the module that makes them (torchvision
//     style, e.g. "layer1.0.conv1"); an in-place op's result keeps the name
//     of the value it updates; saved side tensors end in ".indices",
//     ".mask", ".stats" (batch and layer norm mean and inverse std);
//   - gradients of activations are "<activation>.grad" (with a numeric
//     suffix where several partial gradients exist).
// InvalidArgument for an unknown model (the message lists the known ones),
// a non-positive size, an input too small for the network, heads that do
// not divide the hidden size, or a tensor whose size overflows 64 bits.
absl::StatusOr<Trace> BuildModelTrace(absl::string_view model,
                                      const ModelOptions& options,
                                      const DeviceProfile& device);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_MODEL_TRACES_H_
