#ifndef DELTAD_POLICIES_SIM_STATIC_POLICIES_H_
#define DELTAD_POLICIES_SIM_STATIC_POLICIES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

// The static baselines: each plans its releases once per iteration from the
// program and the budget, then follows the plan.
//   vdnn            vDNN (Rhu et al. 2016): offload the inputs of forward
//                   convolutions, prefetch a fixed distance ahead.
//   lms             IBM TFLMS: offload every activation saved for backward,
//                   swap in a fixed distance ahead.
//   window          Out-of-core window scheduling: offload saved activations,
//                   prefetch what falls within a byte window.
//   chen-sqrt       Chen et al. checkpointing, a checkpoint every
//                   ceil(sqrt(n)) saved activations.
//   chen-greedy     Chen et al.'s budget greedy plan.
//   offload-greedy  GREEDY of the optimal-offloading paper: offload the first
//                   k saved activations, prefetch in order of use.
std::vector<std::string> StaticPolicyNames();

absl::StatusOr<std::unique_ptr<SimPolicy>> MakeStaticPolicy(
    absl::string_view name);

// Makespan lower bounds for a budget. compute_ns: every op must run.
// swap_only_ns: the offloading paper's LB (Proposition 3),
// max(compute, 2 (peak - budget) / beta): at least peak - budget bytes must
// leave the device before the peak step and come back after it. Each way is
// charged at its own rate (excess / d2h + excess / h2d), which is the
// paper's bound for a symmetric link and still a bound for an asymmetric
// one. It assumes what is offloaded is read again (true of saved
// activations).
struct LowerBounds {
  int64_t compute_ns = 0;
  int64_t swap_only_ns = 0;
};

LowerBounds ComputeLowerBounds(const Program& program,
                               const DeviceProfile& device,
                               int64_t budget_bytes);

// The plans, exposed for tests and reports.

// Storages created in the forward pass and read again in a backward step,
// in creation order: what the static baselines release.
std::vector<int32_t> SavedActivations(const Program& program);

// Chen et al.'s sqrt(n) checkpoints: every ceil(sqrt(n))-th saved activation.
std::vector<int32_t> ChenSqrtCheckpoints(const Program& program);

// GREEDY's offload set: the shortest prefix of SavedActivations() whose
// bytes reach peak - budget (all of them when none does; none when the
// program fits).
std::vector<int32_t> OffloadGreedyPrefix(const Program& program,
                                         int64_t budget_bytes);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_STATIC_POLICIES_H_
