#ifndef DELTAD_BENCH_STEADY_STATE_SECTION_H_
#define DELTAD_BENCH_STEADY_STATE_SECTION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "policies/sim/allocator_model.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"

namespace deltad::sim {

struct SteadyStateTrace {
  std::string name;
  const Program* program = nullptr;
  DeviceProfile device;
};

// policy_bench's steady-state section: each policy run for `iterations`
// training iterations back to back, the first included, at each budget
// ratio (of the peak under `allocator`); the total time against as many
// ideal iterations, and delta-steady's planning time against the iteration
// it plans. Its targets: delta-steady no slower in total than any other
// policy in any cell where anything fits, and planning at most 5% of the
// iteration. An error when a run failed.
absl::StatusOr<std::string> SteadyStateSection(
    const std::vector<SteadyStateTrace>& traces,
    const std::vector<std::string>& policies, const std::vector<double>& ratios,
    int iterations, AllocatorKind allocator, int64_t host_bytes);

}  // namespace deltad::sim

#endif  // DELTAD_BENCH_STEADY_STATE_SECTION_H_
