#ifndef DELTAD_BENCH_RANDOM_GRAPH_SECTION_H_
#define DELTAD_BENCH_RANDOM_GRAPH_SECTION_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "policies/sim/allocator_model.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

// Runs one policy on a program at a budget for some iterations, as the
// table does.
using RunPolicyFn = std::function<absl::StatusOr<SimResult>(
    const Program&, const DeviceProfile&, const std::string&, int64_t, int)>;

// policy_bench's comparison on random layer graphs (RandomLayerGraph,
// seeds 1..graphs), which no policy was tuned on: every policy run for
// `iterations` training iterations, the first included, at every budget
// ratio (of the peak of as many iterations under `allocator`), compared
// by their total time; for `delta` and `delta-steady` (where they are
// among `policies`) the cells where they are at or below every other
// policy (ties within 0.5%), the median and worst ratio to the best
// other, and who beat them. An error when a run failed.
absl::StatusOr<std::string> RandomGraphSection(
    int graphs, const std::vector<std::string>& policies,
    const std::vector<double>& ratios, int iterations,
    const DeviceProfile& device, AllocatorKind allocator,
    const RunPolicyFn& run);

}  // namespace deltad::sim

#endif  // DELTAD_BENCH_RANDOM_GRAPH_SECTION_H_
