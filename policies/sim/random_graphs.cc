#include "policies/sim/random_graphs.h"

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace deltad::sim {

Trace RandomLayerGraph(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto log_uniform = [&](double lo, double hi) {
    std::uniform_real_distribution<double> d(std::log(lo), std::log(hi));
    return static_cast<int64_t>(std::exp(d(rng)));
  };
  const int layers = static_cast<int>(uniform(6, 40));
  TraceBuilder b(absl::StrCat("random-", seed));
  const int32_t input = b.Constant("input", log_uniform(4 << 10, 48 << 20));
  std::vector<int32_t> weights;
  std::vector<int32_t> outs = {input};
  // Per layer: what it read (its saved inputs) and its forward time.
  std::vector<std::vector<int32_t>> reads(layers);
  std::vector<int64_t> times(layers);
  for (int i = 0; i < layers; ++i) {
    weights.push_back(
        b.Constant(absl::StrCat("w", i), log_uniform(4 << 10, 16 << 20)));
    reads[i] = {outs.back()};
    if (i >= 2 && uniform(0, 3) == 0) {
      reads[i].push_back(
          outs[uniform(0, static_cast<int64_t>(outs.size()) - 2)]);
    }
    times[i] = log_uniform(20e3, 2e6);
    const int64_t workspace =
        uniform(0, 2) == 0 ? log_uniform(4 << 10, 32 << 20) : 0;
    b.Op("layer", Phase::kForward, times[i], workspace).Input(weights[i]);
    for (int32_t v : reads[i]) b.Input(v);
    outs.push_back(
        b.Output(absl::StrCat("a", i), log_uniform(4 << 10, 48 << 20)));
  }
  // The loss reads the last output; backward walks the layers in reverse,
  // each reading the gradient of its output, its saved inputs and its
  // weights, making the gradient of its input and updating its weights.
  b.Op("loss", Phase::kForward, 1000).Input(outs.back());
  int32_t grad = b.Output("loss.grad", b.trace().values[outs.back()].bytes);
  b.Release(outs.back());
  // Each value's last reader in backward: the lowest layer that read it.
  std::vector<int> last_reader(outs.size(), -1);
  for (int i = 0; i < layers; ++i) {
    for (int32_t v : reads[i]) {
      for (size_t k = 0; k < outs.size(); ++k) {
        if (outs[k] == v && (last_reader[k] < 0 || i < last_reader[k])) {
          last_reader[k] = i;
        }
      }
    }
  }
  for (int i = layers - 1; i >= 0; --i) {
    b.Op("layer_backward", Phase::kBackward, 2 * times[i]).Input(grad);
    for (int32_t v : reads[i]) b.Input(v);
    b.Input(weights[i]);
    const int32_t g = b.Output(absl::StrCat("a", i, ".grad_in"),
                               b.trace().values[reads[i][0]].bytes);
    b.Version(weights[i]);
    b.Release(grad);
    for (size_t k = 0; k < outs.size(); ++k) {
      if (last_reader[k] == i && outs[k] != input) b.Release(outs[k]);
    }
    grad = g;
  }
  b.Release(grad);
  return std::move(b).Build();
}

}  // namespace deltad::sim
