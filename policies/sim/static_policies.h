#ifndef DELTAD_POLICIES_SIM_STATIC_POLICIES_H_
#define DELTAD_POLICIES_SIM_STATIC_POLICIES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
// The swap baselines are in swap_policies.h, the checkpointing ones in
// checkpoint_policies.h, what they know of the program in
// program_analysis.h, and the bounds they are measured against in
// lower_bounds.h.
std::vector<std::string> StaticPolicyNames();

absl::StatusOr<std::unique_ptr<SimPolicy>> MakeStaticPolicy(
    absl::string_view name);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_STATIC_POLICIES_H_
