#ifndef DELTAD_POLICIES_SIM_SWAP_POLICIES_H_
#define DELTAD_POLICIES_SIM_SWAP_POLICIES_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

// The swap baselines of static_policies.h (vdnn, lms, window and
// offload-greedy) by name; null for any other name.
std::unique_ptr<SimPolicy> MakeSwapPolicy(absl::string_view name);

// The plan, exposed for tests and reports.

// GREEDY's offload set: the shortest prefix of SavedActivations() whose
// bytes reach peak - budget (all of them when none does; none when the
// program fits).
std::vector<int32_t> OffloadGreedyPrefix(const Program& program,
                                         int64_t budget_bytes);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_SWAP_POLICIES_H_
