#ifndef DELTAD_POLICIES_SIM_CHECKPOINT_POLICIES_H_
#define DELTAD_POLICIES_SIM_CHECKPOINT_POLICIES_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

// The checkpointing baselines of static_policies.h (chen-sqrt and
// chen-greedy) by name; null for any other name.
std::unique_ptr<SimPolicy> MakeCheckpointPolicy(absl::string_view name);

// The plan, exposed for tests and reports.

// Chen et al.'s sqrt(n) checkpoints: every ceil(sqrt(n))-th saved activation.
std::vector<int32_t> ChenSqrtCheckpoints(const Program& program);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_CHECKPOINT_POLICIES_H_
